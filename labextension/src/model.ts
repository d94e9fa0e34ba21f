/**
 * The panel's data: the snapshots the kernel pushes over the `rpcnb.panel` comm
 * (rpcnb/frontend/panel.py) and what the status item and the panel make of them. Nothing here
 * touches JupyterLab or the DOM, so the jest tests run it as is.
 */

export const TARGET = 'rpcnb.panel';
/** The kernel's hello: a message on this comm id, which no one opens (rpcnb.frontend.panel). */
export const HELLO_ID = 'rpcnb.panel.hello';
export const PROTOCOL = 1;

export interface IMember {
  name: string;
  rank: number;
  host: string;
  pid: number;
  kind: string;
  devices: string[];
  alive: boolean;
  how: string;
  calls: number;
  recent_ms: number | null;
  me: boolean;
  /** it runs a remote cell of this kernel's now (the interrupt button) */
  running?: boolean;
  /** the cell it runs now, whoever sent it, and where it is (null: idle) */
  busy?: IBusy | null;
  memory?: { rss?: number; shm?: number; gpu?: IGpuMemory[] };
}

/** What a busy member runs (rpcnb/membership/view.py's ``running_now``). */
export interface IBusy {
  /** the cell's name, "<worker1 cell 3>" */
  cell: string;
  /** its first line */
  first: string;
  caller: string;
  /** when it started, in seconds since the epoch */
  since: number;
  /** where it is now: the file of the innermost frame in a cell's code ("" if none) */
  file: string;
  line: number;
  text: string;
}

/** "14:02:11": a time of day, as the kernel's %rpc_workers writes it. */
export function clock(seconds: number): string {
  const d = new Date(seconds * 1000);
  return [d.getHours(), d.getMinutes(), d.getSeconds()]
    .map(n => String(n).padStart(2, '0'))
    .join(':');
}

/** A busy member's line: "runs <worker1 cell 3> (import time) since 14:02:11, at line 4:
 * time.sleep(30)"; "" when it runs no cell. */
export function busyText(m: IMember): string {
  const b = m.busy;
  if (!b || !m.alive) {
    return '';
  }
  const first = b.first.length > 40 ? `${b.first.slice(0, 37)}...` : b.first;
  let text = `runs ${b.cell} (${first}) since ${clock(b.since)}`;
  if (b.file) {
    const of = b.file === b.cell ? '' : ` of ${b.file}`;
    text += `, at line ${b.line}${of}: ${b.text}`;
  }
  return text;
}

/** One CUDA device's memory as a member uses it (rpcnb.machine.gpu_memory). */
export interface IGpuMemory {
  device: string;
  allocated: number;
  reserved: number;
  total: number | null;
}

/** Devices' memory, per device "cuda:0 1.2 GB alloc / 2.0 GB reserved / 79.6 GB", as
 * %rpc_workers writes it. */
export function gpuText(gpus: IGpuMemory[]): string {
  return gpus
    .map(
      g =>
        `${g.device} ${bytes(g.allocated)} alloc / ${bytes(g.reserved)} reserved / ` +
        (g.total === null ? 'CUDA not initialised' : bytes(g.total))
    )
    .join('; ');
}

/** A member's devices with their memory: "no GPU", or per device "cuda:0 1.2 GB alloc /
 * 2.0 GB reserved / 79.6 GB". */
export function devicesText(m: IMember): string {
  const gpus = m.memory?.gpu;
  if (!m.devices.length || (gpus && !gpus.length)) {
    return 'cpu (no GPU)';
  }
  if (!gpus) {
    return m.devices.join(', ');
  }
  return gpuText(gpus);
}

/** One kept group of the user's (%rpc_init --keep; rpcnb/membership/kept.py's
 * ``describe``): its workers outlive the kernel that started them. */
export interface IKept {
  name: string;
  /** the keeper's pid */
  pid: number;
  /** its live workers */
  workers: string[];
  /** the workers that died, and how */
  dead: { [worker: string]: string };
  /** when it started, in seconds since the epoch */
  since: number;
  /** the kernel attached ("kernel_PID"), "" for none */
  attached: string;
  /** since when no kernel has been attached (null while one is) */
  idle_since: number | null;
  /** its idle limit: it ends by itself after this many seconds without a kernel */
  keep_s: number;
  /** its keeper's and workers' resident memory, in bytes (null until the keeper asked) */
  memory: number | null;
  /** each live worker's CUDA memory, empty without a GPU (null until the keeper asked) */
  gpu: { [worker: string]: IGpuMemory[] } | null;
  /** this kernel is the one attached */
  mine: boolean;
}

/** A kept group's GPU memory: "no GPU", or each worker's devices ("worker1 cuda:0 ...");
 * "" until its keeper asked. */
export function keptGpuText(k: IKept): string {
  if (!k.gpu) {
    return '';
  }
  const used = Object.entries(k.gpu).filter(([, gpus]) => gpus.length);
  if (!used.length) {
    return 'no GPU';
  }
  return used.map(([w, gpus]) => `${w} ${gpuText(gpus)}`).join('; ');
}

/** The lines under a kept group's name, at the kernel's time ``now``: its workers, the
 * kernel attached or since when none is (of its idle limit), since when it runs and its
 * keeper, its memory. */
export function keptLines(k: IKept, now: number): string[] {
  const dead = Object.keys(k.dead);
  const workers =
    `workers: ${k.workers.join(', ') || 'none'}` +
    (dead.length ? ` (dead: ${dead.join(', ')})` : '');
  let kernel: string;
  if (k.attached) {
    kernel = `attached: ${k.attached}${k.mine ? ' (this kernel)' : ''}`;
  } else {
    const since = k.idle_since ?? now;
    kernel =
      `no kernel attached since ${clock(since)} (${age(since, now)} of ` +
      `${age(0, k.keep_s)})`;
  }
  const memory = [
    k.memory === null ? '' : `memory ${bytes(k.memory)}`,
    keptGpuText(k) ? `GPU: ${keptGpuText(k)}` : ''
  ].filter(Boolean);
  return [
    workers,
    kernel,
    `since ${clock(k.since)} · keeper pid ${k.pid}`,
    ...(memory.length ? [memory.join(' · ')] : [])
  ];
}

/** One of a kept group's buttons in the panel. */
export interface IKeptAction {
  action: 'attach' | 'end';
  label: string;
  title: string;
  enabled: boolean;
}

/** A kept group's buttons: attach, while this kernel is in no group (``inGroup``); end. */
export function keptActions(k: IKept, inGroup: boolean): IKeptAction[] {
  const end: IKeptAction = {
    action: 'end',
    label: 'end',
    title: `End ${k.name}: stop its workers (their namespaces are lost) and remove what it left`,
    enabled: true
  };
  if (inGroup) {
    return [end];
  }
  const attach: IKeptAction = {
    action: 'attach',
    label: 'attach',
    title: k.attached
      ? `${k.attached} is attached to ${k.name}: one kernel drives a kept group at a time`
      : `Make this kernel ${k.name}'s driver again (adds and runs %rpc_init --attach ${k.name})`,
    enabled: !k.attached
  };
  return [attach, end];
}

export interface IGroup {
  me: string;
  leader: string;
  address: string;
  join_line: string;
  size: number;
  alive: number;
}

export interface IRRef {
  key: string;
  names: string[];
  since: number;
  owner: string;
  error?: string | null;
  type?: string;
  shape?: unknown;
  dtype?: string;
  device?: string;
  nbytes?: number;
  preview?: string;
}

/** The tensors that took one of rpcnb's own paths on a pair, and their bytes. */
export interface IPathCount {
  tensors: number;
  bytes: number;
}

/** One ordered pair of the channel matrix (rpcnb/observe/traffic.py's ``Picture.matrix``). */
export interface ICell {
  transport: string;
  channel: string;
  reason: string;
  devices?: { [pair: string]: string };
  calls: number;
  p50_ms: number | null;
  bytes_per_s?: number | null;
  /** the tensors that took rpcnb's own paths ("rpcnb_shm", "zero_copy", "ucx: tcp"...) */
  paths?: { [path: string]: IPathCount };
  /** the UCX transport of the latest tensor sent over UCX ("ucx: cma"), or null */
  ucx?: string | null;
}

export interface ITraffic {
  members: string[];
  matrix: { [pair: string]: ICell };
  series: { [peer: string]: number[][] };
}

export interface ISnapshot {
  protocol: number;
  time: number;
  group: IGroup | null;
  members: IMember[];
  message: string;
  traffic?: ITraffic | null;
  rrefs?: IRRef[];
  /** a cell runs in the kernel: actions that wait for it say so */
  busy?: boolean;
  /** the actions the kernel runs only once no cell runs (rpcnb.frontend.panel) */
  waits?: string[];
  /** the user's kept groups, also while this kernel is in none */
  kept?: IKept[];
}

/** Where the panel's connection to the active kernel stands. */
export type Connection =
  | { state: 'no-notebook' }
  | { state: 'no-kernel' }
  | { state: 'connecting' }
  | { state: 'not-loaded' }
  | { state: 'live'; snapshot: ISnapshot };

export const TEXT = {
  noNotebook:
    'No notebook has focus: the panel follows the notebook you work in.',
  noKernel: 'This notebook has no running kernel.',
  connecting: 'Asking the kernel for its group...',
  busy: 'A cell is running in this notebook.',
  notLoaded:
    'rpcnb is not loaded in this kernel: run %load_ext rpcnb in the notebook, then %rpc_init --workers 2.',
  newerProtocol:
    "This kernel speaks a newer panel protocol than this extension: upgrade the rpcnb package in JupyterLab's environment."
};

export interface IStatus {
  text: string;
  title: string;
  health: 'none' | 'ok' | 'dead';
}

/** The status bar item: "RPC alive/size", red while a member is dead. */
export function statusOf(conn: Connection): IStatus {
  if (conn.state !== 'live') {
    return { text: 'RPC', title: describe(conn), health: 'none' };
  }
  const group = conn.snapshot.group;
  if (!group) {
    return {
      text: 'RPC: no group',
      title: conn.snapshot.message,
      health: 'none'
    };
  }
  const members = conn.snapshot.members;
  const alive = members.filter(m => m.alive).length;
  const dead = members.filter(m => !m.alive).map(m => m.name);
  return {
    text: `RPC ${alive}/${members.length}`,
    title:
      dead.length > 0
        ? `${dead.join(', ')} ${dead.length === 1 ? 'is' : 'are'} dead; click for the RPC panel`
        : `${members.length} members, all alive; click for the RPC panel`,
    health: dead.length > 0 ? 'dead' : 'ok'
  };
}

/** The line the panel shows above its tables. */
export function describe(conn: Connection): string {
  switch (conn.state) {
    case 'no-notebook':
      return TEXT.noNotebook;
    case 'no-kernel':
      return TEXT.noKernel;
    case 'connecting':
      return TEXT.connecting;
    case 'not-loaded':
      return TEXT.notLoaded;
    case 'live': {
      const snap = conn.snapshot;
      if (snap.protocol > PROTOCOL) {
        return TEXT.newerProtocol;
      }
      if (!snap.group) {
        return snap.message;
      }
      const g = snap.group;
      return (
        `Group of ${g.size} led by ${g.leader}; this kernel is ${g.me}.` +
        (snap.busy ? ` ${TEXT.busy}` : '')
      );
    }
  }
}

/** One member's row of cells, as the members table shows them. */
export function memberCells(m: IMember): string[] {
  return [
    m.name + (m.me ? ' (this kernel)' : ''),
    String(m.rank),
    m.host,
    String(m.pid),
    m.kind,
    devicesText(m),
    m.alive ? 'alive' : m.how ? `dead (${m.how})` : 'dead',
    String(m.calls),
    m.recent_ms === null || m.recent_ms === undefined
      ? ''
      : `${m.recent_ms.toFixed(2)} ms`
  ];
}

export const MEMBER_COLUMNS = [
  'name',
  'rank',
  'host',
  'pid',
  'kind',
  'devices',
  'alive',
  'calls',
  'recent'
];

/** The members table's columns; the other facts of a member (MEMBER_DETAILS) go on a
 * line under its name, so the table reads at JupyterLab's default sidebar width. */
export const MEMBER_SHOWN = ['name', 'alive', 'calls', 'recent'];
export const MEMBER_DETAILS = ['kind', 'rank', 'pid', 'host', 'devices'];

/** One of a member's buttons in the panel. */
export interface IMemberAction {
  action: 'restart' | 'interrupt' | 'stacks' | 'who';
  label: string;
  title: string;
  enabled: boolean;
}

/** The buttons of a member's row: interrupt and restart, for the workers this kernel's
 * group started (not this kernel, joined kernels or engines); stacks, for every member. */
export function memberActions(m: IMember): IMemberAction[] {
  const stacks: IMemberAction = {
    action: 'stacks',
    label: 'stacks',
    title: m.alive
      ? `Show where ${m.name} is now: every thread's Python stack, the running cell's first`
      : `${m.name} is dead: it has no stack to show`,
    enabled: m.alive
  };
  if (m.me || m.kind !== 'process') {
    return [stacks];
  }
  return [
    {
      action: 'interrupt',
      label: 'interrupt',
      title: m.running
        ? `Interrupt the cell ${m.name} runs for this notebook (KeyboardInterrupt there; its namespace stays)`
        : `${m.name} runs no cell of this notebook's`,
      enabled: Boolean(m.running) && m.alive
    },
    {
      action: 'restart',
      label: 'restart',
      title: `Start ${m.name} again as a new process (its namespace starts empty)`,
      enabled: true
    },
    stacks
  ];
}

/** The "variables" button of every member's row: its variables as %rpc_who lists them
 * (the kernel answers with the table as text, shown under the panel's note). */
export function variablesAction(m: IMember): IMemberAction {
  return {
    action: 'who',
    label: 'variables',
    title: m.alive
      ? `List ${m.name}'s variables: type, and shape, dtype, device and size of tensors and arrays`
      : `${m.name} is dead: its namespace is lost`,
    enabled: m.alive
  };
}

/** One variable of a member (rpcnb/observe/names.py's ``variables_here``). */
export interface IVariable {
  name: string;
  type: string;
  shape?: number[];
  dtype?: string;
  device?: string;
  nbytes?: number;
  len?: number;
}

/** What the note says while an action waits for the kernel; ``waits``: the actions
 * the kernel holds until the running cell ends (it says which, in its snapshots). */
export function pendingText(
  action: string,
  busy: boolean,
  waits: string[] = []
): string {
  return busy && waits.includes(action)
    ? `${action}: waits for the running cell to end...`
    : `${action}...`;
}

/** A size in bytes as a person reads it. */
export function bytes(n: number | undefined): string {
  if (n === undefined || n === null) {
    return '';
  }
  const units = ['B', 'KB', 'MB', 'GB', 'TB'];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}

/** How long ago `since` (seconds since the epoch) was, at `now`. */
export function age(since: number, now: number): string {
  const s = Math.max(0, Math.round(now - since));
  if (s < 60) {
    return `${s} s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min`;
  }
  return `${Math.floor(s / 3600)} h`;
}

/** One RRef's description: type, shape, dtype, device and size where known. */
export function rrefWhat(r: IRRef): string {
  if (r.error) {
    return r.error;
  }
  const parts = [r.type ?? '?'];
  if (r.shape !== undefined && r.shape !== null) {
    parts.push(JSON.stringify(r.shape));
  }
  for (const p of [r.dtype, r.device, bytes(r.nbytes)]) {
    if (p) {
      parts.push(p);
    }
  }
  return parts.join(' ');
}

/** The points of a latency sparkline (an SVG polyline) for one peer's [t, ms] series. */
export function sparkline(
  points: number[][],
  width: number,
  height: number
): string {
  if (points.length === 0) {
    return '';
  }
  const t0 = points[0][0];
  const t1 = points[points.length - 1][0];
  const top = Math.max(...points.map(p => p[1])) || 1;
  const span = t1 - t0 || 1;
  return points
    .map(([t, ms]) => {
      const x = points.length === 1 ? width / 2 : ((t - t0) / span) * width;
      const y = height - (ms / top) * height;
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    })
    .join(' ');
}

/** What one cell of the channel matrix shows, as the channel monitor's matrix does
 * (rpcnb/frontend/widgets/channel_monitor.js): TensorPipe's transport / channel; under it the
 * UCX transport of the latest tensor sent over UCX ("ucx: cma"; "" if none); under that
 * the tensors that took rpcnb's own paths ("rpcnb_shm ×2 · ucx: cma ×1"; "" if none);
 * and the tooltip (why that channel, the calls, their median latency, each path's bytes). */
export interface ICellText {
  path: string;
  ucx: string;
  paths: string;
  title: string;
}

export function cellText(cell: ICell): ICellText {
  const paths = Object.entries(cell.paths ?? {});
  let title = `${cell.reason}; ${cell.calls} calls`;
  if (cell.p50_ms !== null && cell.p50_ms !== undefined) {
    title += `, p50 ${cell.p50_ms.toFixed(2)} ms`;
  }
  for (const [p, v] of paths) {
    title += `\n${p}: ${v.tensors} ${v.tensors === 1 ? 'tensor' : 'tensors'}, ${bytes(v.bytes)}`;
  }
  return {
    path: `${cell.transport || '?'} / ${cell.channel || '?'}`,
    ucx: cell.ucx ?? '',
    paths: paths.map(([p, v]) => `${p} ×${v.tensors}`).join(' · '),
    title
  };
}
