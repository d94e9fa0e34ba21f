import {
  age,
  bytes,
  cellText,
  Connection,
  ICell,
  busyText,
  clock,
  describe as describeConn,
  IKept,
  IMember,
  ISnapshot,
  keptActions,
  keptGpuText,
  keptLines,
  memberActions,
  memberCells,
  pendingText,
  rrefWhat,
  sparkline,
  statusOf,
  TEXT,
  variablesAction
} from '../model';

function member(
  name: string,
  alive = true,
  extra: Partial<IMember> = {}
): IMember {
  return {
    name,
    rank: 0,
    host: 'box',
    pid: 100,
    kind: 'process',
    devices: [],
    alive,
    how: alive ? '' : 'killed by SIGKILL',
    calls: 3,
    recent_ms: 0.5,
    me: false,
    ...extra
  };
}

function live(members: IMember[]): Connection {
  const snapshot: ISnapshot = {
    protocol: 1,
    time: 1000,
    message: '',
    members,
    group: {
      me: 'worker0',
      leader: 'worker0',
      address: '127.0.0.1:1',
      join_line: 'j',
      size: members.length,
      alive: members.filter(m => m.alive).length
    }
  };
  return { state: 'live', snapshot };
}

describe('status item', () => {
  it('counts the living members of the group', () => {
    const s = statusOf(
      live([member('worker0'), member('worker1'), member('worker2')])
    );
    expect(s.text).toBe('RPC 3/3');
    expect(s.health).toBe('ok');
  });

  it('turns red and names the dead', () => {
    const s = statusOf(
      live([member('worker0'), member('worker1', false), member('worker2')])
    );
    expect(s.text).toBe('RPC 2/3');
    expect(s.health).toBe('dead');
    expect(s.title).toContain('worker1 is dead');
  });

  it('says when there is no group or no rpcnb', () => {
    const none: Connection = {
      state: 'live',
      snapshot: {
        protocol: 1,
        time: 0,
        group: null,
        members: [],
        message: 'No group here.'
      }
    };
    expect(statusOf(none).text).toBe('RPC: no group');
    expect(describeConn(none)).toBe('No group here.');
    expect(statusOf({ state: 'not-loaded' }).health).toBe('none');
    expect(describeConn({ state: 'not-loaded' })).toBe(TEXT.notLoaded);
    expect(describeConn({ state: 'no-notebook' })).toBe(TEXT.noNotebook);
  });

  it('asks for an upgrade when the kernel speaks a newer protocol', () => {
    const conn = live([member('worker0')]);
    if (conn.state === 'live') {
      conn.snapshot.protocol = 2;
    }
    expect(describeConn(conn)).toBe(TEXT.newerProtocol);
  });
});

describe('members table', () => {
  it('shows a dead member with how it died', () => {
    const cells = memberCells(
      member('worker1', false, { devices: ['cuda:0'], me: false })
    );
    expect(cells[0]).toBe('worker1');
    expect(cells[5]).toBe('cuda:0');
    expect(cells[6]).toBe('dead (killed by SIGKILL)');
  });

  it('marks this kernel and a CPU-only member', () => {
    const cells = memberCells(
      member('worker0', true, { me: true, recent_ms: null })
    );
    expect(cells[0]).toBe('worker0 (this kernel)');
    expect(cells[5]).toBe('cpu (no GPU)');
    expect(cells[6]).toBe('alive');
    expect(cells[8]).toBe('');
  });

  it("shows each GPU's memory: allocated, reserved, total", () => {
    const gpu = [
      {
        device: 'cuda:0',
        allocated: 1536 * 2 ** 20,
        reserved: 2 * 2 ** 30,
        total: 80 * 2 ** 30
      },
      { device: 'cuda:1', allocated: 0, reserved: 0, total: null }
    ];
    const cells = memberCells(
      member('worker1', true, {
        devices: ['cuda:0', 'cuda:1'],
        me: false,
        memory: { gpu }
      })
    );
    expect(cells[5]).toBe(
      'cuda:0 1.5 GB alloc / 2.0 GB reserved / 80.0 GB; ' +
        'cuda:1 0 B alloc / 0 B reserved / CUDA not initialised'
    );
  });
});

describe('formatting', () => {
  it('sizes, ages and RRef descriptions', () => {
    expect(bytes(512)).toBe('512 B');
    expect(bytes(64 * 1024 * 1024)).toBe('64.0 MB');
    expect(age(100, 130)).toBe('30 s');
    expect(age(100, 100 + 600)).toBe('10 min');
    expect(
      rrefWhat({
        key: 'k',
        names: ['t'],
        since: 0,
        owner: 'worker1',
        type: 'Tensor',
        shape: [2, 3],
        dtype: 'torch.float32',
        device: 'cpu',
        nbytes: 24
      })
    ).toBe('Tensor [2,3] torch.float32 cpu 24 B');
    expect(
      rrefWhat({
        key: 'k',
        names: [],
        since: 0,
        owner: 'worker1',
        error: 'worker1 is gone'
      })
    ).toBe('worker1 is gone');
  });

  it('draws a sparkline across the width, the highest point at the top', () => {
    const pts = sparkline(
      [
        [0, 1],
        [5, 2],
        [10, 4]
      ],
      100,
      10
    ).split(' ');
    expect(pts).toEqual(['0.0,7.5', '50.0,5.0', '100.0,0.0']);
    expect(sparkline([], 100, 10)).toBe('');
  });
});

describe('channel matrix cell', () => {
  function cell(extra: Partial<ICell> = {}): ICell {
    return {
      transport: 'uv',
      channel: 'cma',
      reason: 'uv: TCP; cma: same host',
      calls: 4,
      p50_ms: 1.5,
      paths: {},
      ucx: null,
      ...extra
    };
  }

  it("shows TensorPipe's path alone while no tensor took one of rpcnb's", () => {
    const t = cellText(cell());
    expect(t.path).toBe('uv / cma');
    expect(t.ucx).toBe('');
    expect(t.paths).toBe('');
    expect(t.title).toBe('uv: TCP; cma: same host; 4 calls, p50 1.50 ms');
  });

  it('shows the UCX transport and the paths that carried tensors, as the monitor does', () => {
    const t = cellText(
      cell({
        ucx: 'ucx: cma',
        paths: {
          'ucx: cma': { tensors: 1, bytes: 4 << 20 },
          rpcnb_shm: { tensors: 3, bytes: 3 << 20 }
        }
      })
    );
    expect(t.path).toBe('uv / cma');
    expect(t.ucx).toBe('ucx: cma');
    expect(t.paths).toBe('ucx: cma ×1 · rpcnb_shm ×3');
    expect(t.title).toContain('\nucx: cma: 1 tensor, 4.0 MB');
    expect(t.title).toContain('\nrpcnb_shm: 3 tensors, 3.0 MB');
  });

  it('takes a kernel that sends neither paths nor ucx (an older rpcnb) and an unknown pair', () => {
    const t = cellText({
      transport: '?',
      channel: '?',
      reason: 'joined moments ago',
      calls: 0,
      p50_ms: null
    });
    expect(t.path).toBe('? / ?');
    expect(t.ucx).toBe('');
    expect(t.paths).toBe('');
    expect(t.title).toBe('joined moments ago; 0 calls');
  });
});

describe('memberActions', () => {
  it('gives a worker interrupt (only while it runs a cell) and restart', () => {
    const idle = memberActions(
      member('worker1', true, { kind: 'process', me: false })
    );
    expect(idle.map(a => [a.action, a.enabled])).toEqual([
      ['interrupt', false],
      ['restart', true],
      ['stacks', true]
    ]);
    const busy = memberActions(
      member('worker1', true, { kind: 'process', me: false, running: true })
    );
    expect(busy[0]).toMatchObject({ action: 'interrupt', enabled: true });
    expect(busy[0].title).toContain('worker1');
  });

  it('gives this kernel, joined kernels and engines only stacks', () => {
    const only = (m: IMember) => memberActions(m).map(a => a.action);
    expect(only(member('worker0', true, { kind: 'kernel', me: true }))).toEqual(
      ['stacks']
    );
    expect(
      only(member('w9', true, { kind: 'joined kernel', me: false }))
    ).toEqual(['stacks']);
    expect(
      only(member('engine0', true, { kind: 'engine', me: false }))
    ).toEqual(['stacks']);
  });

  it('disables stacks for a dead member', () => {
    const stacks = memberActions(member('worker2', false)).find(
      a => a.action === 'stacks'
    );
    expect(stacks).toMatchObject({ enabled: false });
    expect(stacks?.title).toContain('dead');
  });
});

describe('busyText', () => {
  const since = new Date(2025, 0, 1, 14, 2, 11).getTime() / 1000;
  const busy = {
    cell: '<worker1 cell 3>',
    first: 'import time',
    caller: 'worker0',
    since,
    file: '<worker1 cell 3>',
    line: 4,
    text: 'time.sleep(30)'
  };

  it('says the cell, since when, and the line it is at', () => {
    expect(clock(since)).toBe('14:02:11');
    expect(busyText(member('worker1', true, { busy }))).toBe(
      'runs <worker1 cell 3> (import time) since 14:02:11, at line 4: time.sleep(30)'
    );
  });

  it('names the cell of a function defined earlier, and nothing when idle', () => {
    const inner = { ...busy, file: '<worker1 cell 1>', line: 2, text: 'f()' };
    expect(busyText(member('worker1', true, { busy: inner }))).toContain(
      'at line 2 of <worker1 cell 1>: f()'
    );
    const starting = { ...busy, file: '' };
    expect(busyText(member('worker1', true, { busy: starting }))).toBe(
      'runs <worker1 cell 3> (import time) since 14:02:11'
    );
    expect(busyText(member('worker1', true, { busy: null }))).toBe('');
    expect(busyText(member('worker1', false, { busy }))).toBe('');
  });
});

describe('pendingText', () => {
  it('says when an action waits for the running cell', () => {
    const waits = ['add', 'start'];
    expect(pendingText('add', true, waits)).toBe(
      'add: waits for the running cell to end...'
    );
    expect(pendingText('add', false, waits)).toBe('add...');
    expect(pendingText('interrupt', true, waits)).toBe('interrupt...');
  });
});

describe('describe while a cell runs', () => {
  it('says a cell is running, from the snapshot pushed while the kernel is busy', () => {
    const snapshot = {
      protocol: 1,
      time: 0,
      message: '',
      members: [member('worker0', true, { me: true })],
      group: {
        me: 'worker0',
        leader: 'worker0',
        address: 'a',
        join_line: 'j',
        size: 1,
        alive: 1
      },
      busy: true
    };
    expect(describeConn({ state: 'live', snapshot })).toBe(
      `Group of 1 led by worker0; this kernel is worker0. ${TEXT.busy}`
    );
    expect(
      describeConn({ state: 'live', snapshot: { ...snapshot, busy: false } })
    ).toBe('Group of 1 led by worker0; this kernel is worker0.');
  });
});

describe('variablesAction', () => {
  it('lists the variables of every living member, this kernel included', () => {
    for (const m of [
      member('worker1'),
      member('worker0', true, { kind: 'kernel', me: true }),
      member('w9', true, { kind: 'joined kernel' })
    ]) {
      expect(variablesAction(m)).toMatchObject({
        action: 'who',
        label: 'variables',
        enabled: true
      });
    }
    expect(variablesAction(member('worker1')).title).toContain(
      "worker1's variables"
    );
  });

  it('is disabled for a dead member, whose namespace is lost', () => {
    const dead = variablesAction(member('worker2', false));
    expect(dead.enabled).toBe(false);
    expect(dead.title).toContain('namespace is lost');
  });
});

describe('kept groups', () => {
  function kept(extra: Partial<IKept> = {}): IKept {
    return {
      name: 'group1',
      pid: 4242,
      workers: ['worker1', 'worker2'],
      dead: {},
      since: 1000,
      attached: '',
      idle_since: 1100,
      keep_s: 600,
      memory: 300 * 2 ** 20,
      gpu: { worker1: [], worker2: [] },
      mine: false,
      ...extra
    };
  }

  it('says since when no kernel is attached, of its idle limit, and its memory', () => {
    expect(keptLines(kept(), 1100 + 125)).toEqual([
      'workers: worker1, worker2',
      `no kernel attached since ${clock(1100)} (2 min of 10 min)`,
      `since ${clock(1000)} · keeper pid 4242`,
      'memory 300.0 MB · GPU: no GPU'
    ]);
  });

  it('names the kernel attached, this one marked, and the dead workers', () => {
    const lines = keptLines(
      kept({
        attached: 'kernel_7',
        idle_since: null,
        mine: true,
        workers: ['worker1'],
        dead: { worker2: 'killed by SIGKILL' },
        memory: null,
        gpu: null
      }),
      2000
    );
    expect(lines).toEqual([
      'workers: worker1 (dead: worker2)',
      'attached: kernel_7 (this kernel)',
      `since ${clock(1000)} · keeper pid 4242`
    ]);
  });

  it("shows the workers' GPU memory where they have GPUs", () => {
    const gpu = {
      worker1: [
        {
          device: 'cuda:0',
          allocated: 2 ** 30,
          reserved: 2 ** 31,
          total: 2 ** 36
        }
      ],
      worker2: []
    };
    expect(keptGpuText(kept({ gpu }))).toBe(
      'worker1 cuda:0 1.0 GB alloc / 2.0 GB reserved / 64.0 GB'
    );
    expect(keptGpuText(kept({ gpu: null }))).toBe('');
  });

  it('offers attach only to a kernel in no group, and only while none is attached', () => {
    const free = keptActions(kept(), false);
    expect(free.map(a => [a.action, a.enabled])).toEqual([
      ['attach', true],
      ['end', true]
    ]);
    const taken = keptActions(kept({ attached: 'kernel_9' }), false);
    expect(taken[0].enabled).toBe(false);
    expect(taken[0].title).toContain('kernel_9 is attached');
    expect(keptActions(kept(), true).map(a => a.action)).toEqual(['end']);
  });
});
