/**
 * The panel's typed client of the kernel's `rpcnb.panel` comm (rpcnb/frontend/panel.py):
 * which notebook's kernel it follows, the messages it sends and receives, reconnecting
 * when the notebook, the kernel or its rpcnb changes.
 */

import { NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { Signal } from '@lumino/signaling';

import {
  Connection,
  describe,
  HELLO_ID,
  ISnapshot,
  PROTOCOL,
  TARGET
} from './model';

/** How much the kernel sends: everything while the panel shows, counts otherwise. */
export type Detail = 'full' | 'summary';

/** The arguments of one of the panel's actions (start, probe, fetch, free, open, ...). */
export type ActionArgs = { [key: string]: unknown };

/** The kernel's answer to an action. */
export interface IReply {
  ok: boolean;
  message?: string;
  /** "open": the code of a cell to add at the end of the notebook and run. */
  insert?: string;
}

/** What the kernel sends over the comm. */
export type Incoming =
  | { type: 'snapshot'; snapshot: ISnapshot }
  | ({ type: 'reply'; id: number } & IReply);

/** What the panel sends over the comm. */
export type Outgoing =
  | { type: 'watch'; detail: Detail }
  | ({ type: 'action'; action: string; id: number } & ActionArgs);

/**
 * The comm to the active notebook's kernel, re-opened when the notebook, its kernel or
 * the kernel's rpcnb changes (a restart, `%load_ext rpcnb` run later: the kernel says
 * hello on the same target).
 */
export class Link {
  readonly changed = new Signal<Link, Connection>(this);
  conn: Connection = { state: 'no-notebook' };
  private comm: Kernel.IComm | null = null;
  private kernel: Kernel.IKernelConnection | null = null;
  private notebook: NotebookPanel | null = null;
  private detail: Detail = 'summary';
  private nextId = 1;
  private pending = new Map<number, (reply: IReply) => void>();
  // set by a kernel restart: connect again once the new kernel is idle (only then: a
  // kernel without rpcnb answers each open with a close, and every open makes it busy
  // and idle again, so opening on every idle would never stop)
  private reopen = false;

  follow(notebook: NotebookPanel | null): void {
    if (notebook === this.notebook) {
      return;
    }
    if (this.notebook) {
      this.notebook.sessionContext.kernelChanged.disconnect(
        this.onKernel,
        this
      );
      this.notebook.sessionContext.statusChanged.disconnect(
        this.onStatus,
        this
      );
    }
    this.notebook = notebook;
    if (notebook) {
      notebook.sessionContext.kernelChanged.connect(this.onKernel, this);
      notebook.sessionContext.statusChanged.connect(this.onStatus, this);
      void notebook.sessionContext.ready.then(() => {
        if (this.notebook === notebook) {
          this.attach(notebook.sessionContext.session?.kernel ?? null);
        }
      });
    }
    this.attach(notebook?.sessionContext.session?.kernel ?? null);
  }

  /** "full" while the panel is showing, "summary" (counts only) otherwise. */
  watch(detail: Detail): void {
    this.detail = detail;
    this.send({ type: 'watch', detail });
  }

  /** Ask the kernel to run one of the panel's actions; resolves with its reply. */
  act(action: string, args: ActionArgs = {}): Promise<IReply> {
    if (!this.comm || this.comm.isDisposed) {
      return Promise.resolve({ ok: false, message: describe(this.conn) });
    }
    const id = this.nextId++;
    const done = new Promise<IReply>(resolve => this.pending.set(id, resolve));
    this.send({ type: 'action', action, id, ...args });
    return done;
  }

  get notebookPanel(): NotebookPanel | null {
    return this.notebook;
  }

  private onKernel(): void {
    this.attach(this.notebook?.sessionContext.session?.kernel ?? null);
  }

  private onStatus(): void {
    const status = this.notebook?.sessionContext.kernelDisplayStatus;
    if (status === 'restarting' || status === 'autorestarting') {
      this.closeComm();
      this.reopen = true;
      this.set({ state: 'connecting' });
    } else if (status === 'idle' && this.reopen && this.kernel && !this.comm) {
      this.reopen = false;
      this.open();
    }
  }

  private attach(kernel: Kernel.IKernelConnection | null): void {
    if (kernel === this.kernel && (this.comm || !kernel)) {
      if (!this.notebook) {
        this.set({ state: 'no-notebook' });
      }
      return;
    }
    this.closeComm();
    this.reopen = false;
    if (this.kernel && !this.kernel.isDisposed) {
      this.kernel.removeCommTarget(TARGET, this.onHello);
      this.kernel.iopubMessage.disconnect(this.onIopub, this);
    }
    this.kernel = kernel;
    if (!this.notebook) {
      this.set({ state: 'no-notebook' });
      return;
    }
    if (!kernel) {
      this.set({ state: 'no-kernel' });
      return;
    }
    kernel.registerCommTarget(TARGET, this.onHello); // an older rpcnb's hello
    kernel.iopubMessage.connect(this.onIopub, this);
    this.open();
  }

  /** The kernel's hello: a comm message on HELLO_ID (see rpcnb.frontend.panel). */
  private onIopub(
    _kernel: Kernel.IKernelConnection,
    msg: KernelMessage.IIOPubMessage
  ): void {
    if (
      msg.header.msg_type === 'comm_msg' &&
      (msg as KernelMessage.ICommMsgMsg).content.comm_id === HELLO_ID &&
      this.kernel &&
      !this.kernel.isDisposed
    ) {
      this.closeComm();
      this.open();
    }
  }

  /** The kernel ran `%load_ext rpcnb` (again): connect now. */
  private onHello = (comm: Kernel.IComm): void => {
    comm.onClose = () => undefined;
    if (this.kernel && !this.kernel.isDisposed) {
      this.closeComm();
      this.open();
    }
  };

  private open(): void {
    const kernel = this.kernel;
    if (!kernel || kernel.isDisposed) {
      return;
    }
    this.set({ state: 'connecting' });
    let comm: Kernel.IComm;
    // JupyterLab 4.6 sends a comm's messages over one kernel subshell per comm target,
    // reference-counted; a comm that joins the target's subshell while the last one's
    // close is deleting it (the kernel's hello does exactly that) sends into a deleted
    // subshell, and the kernel drops its messages. This comm uses the main shell (its
    // actions wait for a running cell to end): createComm takes the kernel's setting
    // from this field, set only for this call so that no other comm is touched.
    const k = kernel as unknown as { _commsOverSubshells?: string };
    const saved = k._commsOverSubshells;
    try {
      if (saved !== undefined) {
        k._commsOverSubshells = 'disabled';
      }
      comm = kernel.createComm(TARGET);
    } catch (err) {
      this.set({ state: 'not-loaded' });
      return;
    } finally {
      if (saved !== undefined) {
        k._commsOverSubshells = saved;
      }
    }
    this.comm = comm;
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) =>
      this.receive(msg.content.data as unknown as Incoming);
    comm.onClose = () => {
      // the kernel has no such target (rpcnb not loaded) or went away
      if (this.comm === comm) {
        this.comm = null;
        this.set(
          kernel.isDisposed ? { state: 'no-kernel' } : { state: 'not-loaded' }
        );
      }
    };
    comm.open({ detail: this.detail, protocol: PROTOCOL });
  }

  private closeComm(): void {
    const comm = this.comm;
    this.comm = null;
    if (comm && !comm.isDisposed) {
      try {
        comm.close();
      } catch (err) {
        // the kernel is gone already
      }
    }
    for (const resolve of this.pending.values()) {
      resolve({ ok: false, message: 'the kernel went away' });
    }
    this.pending.clear();
  }

  private send(msg: Outgoing): void {
    if (this.comm && !this.comm.isDisposed) {
      this.comm.send(msg as unknown as Parameters<Kernel.IComm['send']>[0]);
    }
  }

  private receive(data: Incoming): void {
    if (data.type === 'snapshot') {
      this.set({ state: 'live', snapshot: data.snapshot });
    } else if (data.type === 'reply') {
      const resolve = this.pending.get(data.id);
      this.pending.delete(data.id);
      resolve?.(data);
    }
  }

  private set(conn: Connection): void {
    this.conn = conn;
    this.changed.emit(conn);
  }
}
