/**
 * The panel's views: the "RPC" side panel (members, channels, RRefs, the actions) and the
 * status bar item, both drawn from the link's latest snapshot.
 */

import { Widget } from '@lumino/widgets';

import { GROUP_ACTIONS, runAction } from './actions';
import { ActionArgs, Link } from './comm';
import {
  age,
  busyText,
  cellText,
  describe,
  ISnapshot,
  keptActions,
  keptLines,
  MEMBER_COLUMNS,
  MEMBER_DETAILS,
  MEMBER_SHOWN,
  memberActions,
  memberCells,
  rrefWhat,
  sparkline,
  statusOf,
  variablesAction
} from './model';

export const PANEL_ID = 'rpcnb-panel';

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
export class RpcPanel extends Widget {
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

  private run(action: string, args: ActionArgs = {}): Promise<void> {
    return runAction(this.link, this.note, action, args);
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
      for (const { label, action, args } of GROUP_ACTIONS) {
        const b = el('button', 'jp-Button rpcnb-panel-button', label);
        b.dataset.action = action;
        b.onclick = () => void this.run(action, args);
        actions.append(b);
      }
      body.append(actions);
    }
    if (snap.kept && snap.kept.length) {
      body.append(el('h3', '', 'Kept groups'), this.kept(snap));
    }
    if (snap.rrefs && snap.rrefs.length) {
      body.append(el('h3', '', 'RRefs held by this kernel'), this.rrefs(snap));
    }
  }

  /** The user's kept groups (%rpc_groups), each with its lines and its buttons. */
  private kept(snap: ISnapshot): HTMLElement {
    const table = el('table', 'rpcnb-panel-kept');
    for (const k of snap.kept ?? []) {
      const row = el('tr', Object.keys(k.dead).length ? 'rpcnb-kept-dead' : '');
      row.dataset.group = k.name;
      row.dataset.attached = k.attached
        ? k.mine
          ? 'this kernel'
          : 'yes'
        : 'no';
      const td = el('td');
      td.append(el('div', 'rpcnb-member-name', k.name));
      for (const line of keptLines(k, snap.time)) {
        td.append(el('div', 'rpcnb-member-details', line));
      }
      const box = el('div', 'rpcnb-member-actions');
      for (const b of keptActions(k, Boolean(snap.group))) {
        const button = el('button', 'jp-Button rpcnb-panel-button', b.label);
        button.dataset.action = b.action;
        button.title = b.title;
        button.disabled = !b.enabled;
        button.onclick = () => {
          const ask = `End kept group ${k.name}? Its workers stop, and what they hold is lost.`;
          if (b.action !== 'end' || window.confirm(ask)) {
            void this.run(b.action, { group: k.name });
          }
        };
        box.append(button);
      }
      td.append(box);
      row.append(td);
      table.append(row);
    }
    return table;
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
    for (const c of MEMBER_SHOWN) {
      tr.append(el('th', '', c));
    }
    table.append(tr);
    for (const m of snap.members) {
      const row = el('tr', m.alive ? 'rpcnb-alive' : 'rpcnb-dead');
      row.dataset.member = m.name;
      const cells = memberCells(m);
      const text = (col: string) => cells[MEMBER_COLUMNS.indexOf(col)];
      for (const col of MEMBER_SHOWN) {
        const td = el('td', '', col === 'name' ? '' : text(col));
        td.dataset.col = col;
        row.append(td);
      }
      // the name cell: the name, a line of details, the member's buttons
      const name = row.firstElementChild as HTMLElement;
      name.append(el('div', 'rpcnb-member-name', text('name')));
      const details = el('div', 'rpcnb-member-details');
      MEMBER_DETAILS.forEach((col, i) => {
        const label = col === 'rank' || col === 'pid' ? `${col} ` : '';
        if (i) {
          details.append(' · ');
        }
        const span = el('span', '', text(col));
        span.dataset.col = col;
        details.append(label, span);
      });
      name.append(details);
      const busy = busyText(m);
      if (busy) {
        // what it runs, since when, and where it is now
        name.append(el('div', 'rpcnb-member-busy', busy));
      }
      const buttons = [...memberActions(m), variablesAction(m)];
      if (buttons.length) {
        const box = el('div', 'rpcnb-member-actions');
        for (const b of buttons) {
          const button = el('button', 'jp-Button rpcnb-panel-button', b.label);
          button.dataset.action = b.action;
          button.title = b.title;
          button.disabled = !b.enabled;
          button.onclick = () => void this.run(b.action, { member: m.name });
          box.append(button);
        }
        name.append(box);
      }
      const series = snap.traffic?.series?.[m.name];
      if (series && series.length) {
        const svg = document.createElementNS(
          'http://www.w3.org/2000/svg',
          'svg'
        );
        svg.setAttribute('class', 'rpcnb-panel-spark');
        svg.setAttribute('width', '48');
        svg.setAttribute('height', '14');
        const line = document.createElementNS(
          'http://www.w3.org/2000/svg',
          'polyline'
        );
        line.setAttribute('points', sparkline(series, 48, 14));
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
        const name = window.prompt(
          'Fetch into which notebook variable?',
          'value'
        );
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
export class RpcStatus extends Widget {
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
