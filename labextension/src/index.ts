/**
 * rpcnb's JupyterLab extension: the "RPC" side panel and the status bar item for the
 * group of the notebook that has focus. The data comes from the kernel itself, over a
 * comm to the `rpcnb.panel` target (rpcnb/frontend/panel.py); no server extension, no polling.
 */

import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import {
  age,
  cellText,
  Connection,
  describe,
  ISnapshot,
  MEMBER_COLUMNS,
  memberCells,
  PROTOCOL,
  rrefWhat,
  sparkline,
  statusOf,
  TARGET
} from './model';

const PANEL_ID = 'rpcnb-panel';

/**
 * The comm to the active notebook's kernel, re-opened when the notebook, its kernel or
 * the kernel's rpcnb changes (a restart, `%load_ext rpcnb` run later: the kernel says
 * hello on the same target).
 */
class Link {
  readonly changed = new Signal<Link, Connection>(this);
  conn: Connection = { state: 'no-notebook' };
  private comm: Kernel.IComm | null = null;
  private kernel: Kernel.IKernelConnection | null = null;
  private notebook: NotebookPanel | null = null;
  private detail = 'summary';
  private nextId = 1;
  private pending = new Map<number, (reply: any) => void>();
  // set by a kernel restart: connect again once the new kernel is idle (only then: a
  // kernel without rpcnb answers each open with a close, and every open makes it busy
  // and idle again, so opening on every idle would never stop)
  private reopen = false;

  follow(notebook: NotebookPanel | null): void {
    if (notebook === this.notebook) {
      return;
    }
    if (this.notebook) {
      this.notebook.sessionContext.kernelChanged.disconnect(this.onKernel, this);
      this.notebook.sessionContext.statusChanged.disconnect(this.onStatus, this);
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
  watch(detail: string): void {
    this.detail = detail;
    if (this.comm && !this.comm.isDisposed) {
      this.comm.send({ type: 'watch', detail });
    }
  }

  /** Ask the kernel to run one of the panel's actions; resolves with its reply. */
  act(action: string, args: { [key: string]: unknown } = {}): Promise<any> {
    if (!this.comm || this.comm.isDisposed) {
      return Promise.resolve({ ok: false, message: describe(this.conn) });
    }
    const id = this.nextId++;
    const done = new Promise(resolve => this.pending.set(id, resolve));
    this.comm.send({ type: 'action', action, id, ...args } as any);
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
    kernel.registerCommTarget(TARGET, this.onHello);
    this.open();
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
    const k = kernel as any;
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
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => this.receive(msg.content.data as any);
    comm.onClose = () => {
      // the kernel has no such target (rpcnb not loaded) or went away
      if (this.comm === comm) {
        this.comm = null;
        this.set(kernel.isDisposed ? { state: 'no-kernel' } : { state: 'not-loaded' });
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

  private receive(data: any): void {
    if (data.type === 'snapshot') {
      this.set({ state: 'live', snapshot: data.snapshot as ISnapshot });
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

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls = '',
  text = ''
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (cls) {
    node.className = cls;
  }
  if (text) {
    node.textContent = text;
  }
  return node;
}

/** The "RPC" side panel. */
class RpcPanel extends Widget {
  private body: HTMLElement;
  private note: HTMLElement;

  constructor(private link: Link) {
    super();
    this.id = PANEL_ID;
    this.addClass('rpcnb-panel');
    this.title.label = 'RPC';
    this.title.caption = 'rpcnb: the group of the notebook that has focus';
    this.note = el('div', 'rpcnb-panel-note');
    this.body = el('div', 'rpcnb-panel-body');
    this.node.append(this.body, this.note);
    link.changed.connect(() => this.render());
    this.render();
  }

  protected onAfterShow(): void {
    this.link.watch('full');
    this.render();
  }

  protected onAfterHide(): void {
    this.link.watch('summary');
  }

  private async run(action: string, args: { [key: string]: unknown } = {}): Promise<void> {
    this.note.textContent = `${action}...`;
    const reply = await this.link.act(action, args);
    this.note.textContent = reply.message ?? '';
    this.note.classList.toggle('rpcnb-panel-error', !reply.ok);
    const nb = this.link.notebookPanel;
    if (reply.ok && reply.insert && nb) {
      // "open": a cell with the magic, added at the end of the notebook and run
      const model = nb.content.model;
      if (model) {
        model.sharedModel.insertCell(model.cells.length, {
          cell_type: 'code',
          source: reply.insert
        });
        nb.content.activeCellIndex = model.cells.length - 1;
        await NotebookActions.run(nb.content, nb.sessionContext);
      }
    }
  }

  render(): void {
    const conn = this.link.conn;
    const body = this.body;
    body.textContent = '';
    const head = el('div', 'rpcnb-panel-message', describe(conn));
    body.append(head);
    if (conn.state !== 'live') {
      return;
    }
    const snap = conn.snapshot;
    body.dataset.group = snap.group ? 'yes' : 'no';
    if (!snap.group) {
      body.append(this.startForm());
    } else {
      body.append(el('h3', '', 'Members'), this.members(snap));
      if (snap.traffic) {
        body.append(el('h3', '', 'Channels'), this.channels(snap));
      }
      const actions = el('div', 'rpcnb-panel-actions');
      for (const [label, action, args] of [
        ['Probe', 'probe', {}],
        ['Channel monitor', 'open', { what: 'channels' }],
        ['Device maps', 'open', { what: 'devmap' }],
        ['Shut down', 'shutdown', {}]
      ] as [string, string, { [key: string]: unknown }][]) {
        const b = el('button', 'jp-Button rpcnb-panel-button', label);
        b.dataset.action = action;
        b.onclick = () => void this.run(action, args);
        actions.append(b);
      }
      body.append(actions);
    }
    if (snap.rrefs && snap.rrefs.length) {
      body.append(el('h3', '', 'RRefs held by this kernel'), this.rrefs(snap));
    }
  }

  private startForm(): HTMLElement {
    const form = el('form', 'rpcnb-panel-start');
    const workers = el('input') as HTMLInputElement;
    workers.type = 'number';
    workers.min = '0';
    workers.value = '2';
    workers.name = 'workers';
    const map = el('input') as HTMLInputElement;
    map.name = 'device_map';
    map.placeholder = 'device map (optional)';
    const go = el('button', 'jp-Button rpcnb-panel-button', 'Start a group');
    go.type = 'submit';
    form.append(el('label', '', 'workers '), workers, map, go);
    form.onsubmit = ev => {
      ev.preventDefault();
      void this.run('start', { workers: workers.value, device_map: map.value });
    };
    return form;
  }

  private members(snap: ISnapshot): HTMLElement {
    const table = el('table', 'rpcnb-panel-members');
    const tr = el('tr');
    for (const c of MEMBER_COLUMNS) {
      tr.append(el('th', '', c));
    }
    table.append(tr);
    for (const m of snap.members) {
      const row = el('tr', m.alive ? 'rpcnb-alive' : 'rpcnb-dead');
      row.dataset.member = m.name;
      memberCells(m).forEach((text, i) => {
        const td = el('td', '', text);
        td.dataset.col = MEMBER_COLUMNS[i];
        row.append(td);
      });
      const series = snap.traffic?.series?.[m.name];
      if (series && series.length) {
        const svg = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
        svg.setAttribute('class', 'rpcnb-panel-spark');
        svg.setAttribute('width', '60');
        svg.setAttribute('height', '14');
        const line = document.createElementNS('http://www.w3.org/2000/svg', 'polyline');
        line.setAttribute('points', sparkline(series, 60, 14));
        svg.append(line);
        row.lastElementChild?.append(svg);
      }
      table.append(row);
    }
    return table;
  }

  private channels(snap: ISnapshot): HTMLElement {
    const traffic = snap.traffic!;
    const table = el('table', 'rpcnb-panel-channels');
    const head = el('tr');
    head.append(el('th', '', 'from \\ to'));
    for (const b of traffic.members) {
      head.append(el('th', '', b));
    }
    table.append(head);
    for (const a of traffic.members) {
      const row = el('tr');
      row.append(el('th', '', a));
      for (const b of traffic.members) {
        const cell = traffic.matrix[`${a}->${b}`];
        const td = el('td');
        if (cell) {
          // as the channel monitor: TensorPipe's path, then UCX's transport and the
          // tensors that took rpcnb's own paths on this pair, where there were any
          const text = cellText(cell);
          td.dataset.pair = `${a}->${b}`;
          td.title = text.title;
          td.append(el('div', 'rpcnb-panel-path', text.path));
          if (text.ucx) {
            td.append(el('div', 'rpcnb-panel-path rpcnb-panel-ucx', text.ucx));
          }
          if (text.paths) {
            td.append(el('div', 'rpcnb-panel-paths', text.paths));
          }
        }
        row.append(td);
      }
      table.append(row);
    }
    return table;
  }

  private rrefs(snap: ISnapshot): HTMLElement {
    const table = el('table', 'rpcnb-panel-rrefs');
    const now = snap.time;
    for (const r of snap.rrefs ?? []) {
      const row = el('tr');
      row.dataset.key = r.key;
      row.append(
        el('td', 'rpcnb-rref-names', r.names.join(', ')),
        el('td', '', r.owner),
        el('td', '', rrefWhat(r)),
        el('td', '', age(r.since, now))
      );
      const buttons = el('td');
      const fetch = el('button', 'jp-Button rpcnb-panel-button', 'fetch');
      fetch.dataset.action = 'fetch';
      fetch.onclick = () => {
        const name = window.prompt('Fetch into which notebook variable?', 'value');
        if (name) {
          void this.run('fetch', { key: r.key, name });
        }
      };
      const free = el('button', 'jp-Button rpcnb-panel-button', 'free');
      free.dataset.action = 'free';
      free.onclick = () => void this.run('free', { key: r.key });
      buttons.append(fetch, free);
      row.append(buttons);
      table.append(row);
    }
    return table;
  }
}

/** The status bar item: "RPC 3/3", red while a member is dead; a click opens the panel. */
class RpcStatus extends Widget {
  constructor(link: Link, onClick: () => void) {
    super();
    this.addClass('rpcnb-status-item');
    this.node.onclick = onClick;
    const render = () => {
      const s = statusOf(link.conn);
      this.node.textContent = s.text;
      this.node.title = s.title;
      this.node.dataset.health = s.health;
    };
    link.changed.connect(render);
    render();
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'rpcnb:panel',
  description: "rpcnb's RPC side panel and status bar item",
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILabShell, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null
  ) => {
    const link = new Link();
    const panel = new RpcPanel(link);
    app.shell.add(panel, 'right', { rank: 900 });
    if (statusBar) {
      statusBar.registerStatusItem('rpcnb:status', {
        item: new RpcStatus(link, () => app.shell.activateById(PANEL_ID)),
        align: 'left',
        rank: 5
      });
    }
    tracker.currentChanged.connect((_, nb) => link.follow(nb));
    link.follow(tracker.currentWidget);
    app.commands.addCommand('rpcnb:open-panel', {
      label: 'Open the RPC panel',
      execute: () => app.shell.activateById(PANEL_ID)
    });
  }
};

export default plugin;
