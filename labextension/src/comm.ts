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
  IVariable,
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
  /** "join": the line to put on the clipboard. */
  copy?: string;
  /** "stacks", "who": a block of text to show as it is (monospace), under the message. */
  text?: string;
  /** "who": the member's variables, the rows of that text. */
  variables?: IVariable[];
}

/** What the kernel sends over the comm. */
export type Incoming =
  | { type: 'snapshot'; snapshot: ISnapshot }
  | ({ type: 'reply'; id: number } & IReply);

/** What the panel sends over the comm. */
export type Outgoing =
  | { type: 'watch'; detail: Detail }
  | ({ type: 'action'; action: string; id: number } & ActionArgs);

/** How long the kernel has to answer a subshell request before the main shell is used. */
const SUBSHELL_WAIT_MS = 5000;

/** A new subshell of ``kernel`` (its id), or null where it has none. Asked on the
 * control channel, which a kernel answers while a cell runs on the main shell; null too
 * when no answer came within SUBSHELL_WAIT_MS. */
async function askSubshell(
  kernel: Kernel.IKernelConnection
): Promise<string | null> {
  const known = await Promise.race([
    kernel.info.then(() => true),
    new Promise<boolean>(resolve => setTimeout(() => resolve(false), 300))
  ]);
  if (known && !kernel.supportsSubshells) {
    return null;
  }
  const msg =
    KernelMessage.createMessage<KernelMessage.ICreateSubshellRequestMsg>({
      msgType: 'create_subshell_request',
      channel: 'control',
      username: kernel.username,
      session: kernel.clientId,
      content: {}
    });
  try {
    const reply = await Promise.race([
      kernel.sendControlMessage(msg, true, true).done,
      new Promise<null>(resolve =>
        setTimeout(() => resolve(null), SUBSHELL_WAIT_MS)
      )
    ]);
    const content = reply?.content as
      { status?: string; subshell_id?: string } | undefined;
    return content?.status === 'ok' && content.subshell_id
      ? content.subshell_id
      : null;
  } catch (err) {
    return null; // a kernel without subshells: the main shell
  }
}

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
  // The panel's subshell on each kernel: asked for once and kept for every comm the panel
  // opens there, never given back (it goes with the kernel, and a restart forgets it).
  // Giving each comm's subshell back when the comm closed raced with the comm's own
  // messages: the kernel dropped those that came after ("Unknown subshell_id"), and the
  // panel went deaf (the busy-panel browser test, about one run in three).
  private subshellOf = new WeakMap<
    Kernel.IKernelConnection,
    Promise<string | null>
  >();
  // set by a kernel restart: connect again once the new kernel is idle (only then: a
  // kernel without rpcnb answers each open with a close, and every open makes it busy
  // and idle again, so opening on every idle would never stop)
  private reopen = false;
  // kernel restarts seen: a restart keeps the kernel's connection object, so an open()
  // that was waiting for a subshell of the old kernel must not use it on the new one
  private restarts = 0;

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
      this.restarts += 1;
      if (this.kernel) {
        this.subshellOf.delete(this.kernel); // it went with the old kernel
      }
      this.closeComm(false);
      this.reopen = true;
      this.set({ state: 'connecting' });
    } else if (status === 'idle' && this.reopen && this.kernel && !this.comm) {
      this.reopen = false;
      void this.open();
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
    void this.open();
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
      void this.open();
    }
  }

  /** The kernel ran `%load_ext rpcnb` (again): connect now. */
  private onHello = (comm: Kernel.IComm): void => {
    comm.onClose = () => undefined;
    if (this.kernel && !this.kernel.isDisposed) {
      this.closeComm();
      void this.open();
    }
  };

  private async open(): Promise<void> {
    const kernel = this.kernel;
    if (!kernel || kernel.isDisposed) {
      return;
    }
    this.set({ state: 'connecting' });
    const restarts = this.restarts;
    // The panel's comm lives on a kernel subshell of its own (ipykernel 7+), so that its
    // opening, its snapshots and its actions are handled while a cell runs on the main
    // shell. JupyterLab's own comms-over-subshells waits for the kernel's info first,
    // which a busy kernel gives only when its cell ends (the panel said "Asking the
    // kernel..." all along), and shares one subshell per target, which a reopening comm
    // can lose: so the comm is made without, and given a subshell asked for here on the
    // control channel (answered while the main shell is busy). A kernel without
    // subshells: the main shell, after the running cell.
    const subshell = await this.subshellFor(kernel);
    if (restarts !== this.restarts) {
      // the kernel restarted meanwhile: the subshell went with the old one, and the new
      // kernel would drop (and log) a comm opened on it; onStatus opens again when idle
      return;
    }
    if (kernel !== this.kernel || kernel.isDisposed) {
      return;
    }
    let comm: Kernel.IComm;
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
    if (subshell) {
      // the field CommHandler sends every message of the comm on (services 4.4+)
      (comm as unknown as { _subshellId: string | null })._subshellId =
        subshell;
    }
    const previous = this.comm;
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
    if (previous && !previous.isDisposed) {
      this.closeOne(previous);
    }
    comm.open({ detail: this.detail, protocol: PROTOCOL });
  }

  private closeOne(comm: Kernel.IComm): void {
    comm.onClose = () => undefined;
    try {
      comm.close();
    } catch (err) {
      // the kernel is gone already
    }
  }

  /** The panel's subshell on ``kernel`` (null: none, the main shell); a kernel that did
   * not give one is asked again next time. */
  private subshellFor(
    kernel: Kernel.IKernelConnection
  ): Promise<string | null> {
    let subshell = this.subshellOf.get(kernel);
    if (!subshell) {
      subshell = askSubshell(kernel);
      this.subshellOf.set(kernel, subshell);
      void subshell.then(id => {
        if (id === null && this.subshellOf.get(kernel) === subshell) {
          this.subshellOf.delete(kernel);
        }
      });
    }
    return subshell;
  }

  /** Close the comm; ``tellKernel`` false when the kernel restarts: the new kernel
   * knows neither the comm nor its subshell, and would drop (and log) what is sent. */
  private closeComm(tellKernel = true): void {
    const comm = this.comm;
    this.comm = null;
    if (comm && !comm.isDisposed) {
      if (tellKernel) {
        this.closeOne(comm);
      } else {
        comm.onClose = () => undefined;
        comm.dispose();
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
