"""The notebook as the workers' console (issue 50), in real kernels whose front end takes
input (jupyter_client with stdin, answered as a person would): input(), getpass and
sys.stdin on a worker, breakpoints in a remote cell and in a function called with
rpc_sync, post-mortem with %debug and %pdb, and interrupts that say what happened.
"""

from __future__ import annotations

import time

import pytest

DEEP = """\
def inner(x):
    y = x * 2
    return y / 0
def middle(x):
    return inner(x + 1)
def outer():
    local_here = 'kept'
    return middle(40)
outer()
"""


def test_input_asks_in_the_notebook_with_the_workers_name(group):
    out = group.execute("%%remote worker1 --fetch\nname = input('name? ')\nname.upper()",
                        answers=["ada"])
    assert out.prompts == [("[worker1] name? ", False)]
    assert out.text == "'ADA'"
    # the value stays in the worker's namespace, as a local cell's would
    assert group.execute("%%remote worker1 --fetch\nname").text == "'ada'"


def test_getpass_and_stdin_are_asked_too(group):
    code = ("import getpass, sys\nsecret = getpass.getpass('token: ')\n"
            "line = sys.stdin.readline()\n(len(secret), line)")
    out = group.execute("%%remote worker2 --fetch\n" + code, answers=["s3cret", "a line"])
    assert out.prompts == [("[worker2] token: ", True), ("[worker2] ", False)]
    assert out.text == "(6, 'a line\\n')"


def test_output_printed_before_a_prompt_arrives_before_it(group):
    out = group.execute("%%remote worker1 --fetch\nprint('before the question')\n"
                        "input('answer: ')", answers=["42"])
    # as the kernel sent them (a front end shows each channel's messages as they come)
    asked = next(t for kind, _, t in out.sent if kind == "input_request")
    printed = next(t for kind, text, t in out.sent
                   if kind == "stdout" and "before the question" in text)
    assert printed <= asked
    assert out.text == "'42'"


def test_several_workers_asking_are_answered_one_after_another(group):
    out = group.execute("%%remote --all --fetch\ninput('who? ')",
                        answers=lambda prompt: prompt.split("]")[0].strip("["))
    assert sorted(p for p, _ in out.prompts) == ["[worker1] who? ", "[worker2] who? "]
    results = group.value("_")
    assert results == {"worker1": "worker1", "worker2": "worker2"}


def test_nobody_to_answer_is_an_error_at_once_that_says_why(group):
    # a front end without stdin (a headless run)
    t0 = time.monotonic()
    out = group.execute("%%remote worker1\ninput('x? ')", allow_error=True, allow_stdin=False)
    assert time.monotonic() - t0 < 10
    assert "NoInput" in out.traceback and "takes no input" in out.traceback, out.traceback
    # a background cell: the error says so and what to do instead
    group.execute("%%remote worker1 --bg -o h\ntry:\n    input('x? ')\n"
                  "except EOFError as e:\n    caught = str(e)\ncaught")
    assert group.value("h.wait(30)") is True
    said = group.execute("%%remote worker1 --fetch\ncaught").text
    assert "background" in said and "--push" in said
    # the worker goes on
    assert group.execute("%%remote worker1 --fetch\n1 + 1").text == "2"


def test_input_in_a_function_called_with_rpc_sync(group):
    group.execute("def ask_there():\n    return input('via rpc: ')")
    out = group.execute("import torch.distributed.rpc as rpc\n"
                        "rpc.rpc_sync('worker2', ask_there)", answers=["fine"])
    assert out.prompts == [("[worker2] via rpc: ", False)]
    assert out.text == "'fine'"


def test_a_breakpoint_in_a_remote_cell_is_a_pdb_session_in_the_cell(group):
    code = "x = 41\nbreakpoint()\ny = x + 1\nz = y * 2\nz"
    out = group.execute("%%remote worker1 --fetch\n" + code,
                        answers=["p x", "!x = 100", "n", "p y", "l", "w", "c"])
    assert [p for p, _ in out.prompts] == ["[worker1] (Pdb) "] * 7
    lines = out.stdout.splitlines()
    assert "41" in lines and "101" in lines, out.stdout  # x, then y from the x set at the prompt
    assert "  3  ->\tz = y * 2" in out.stdout or "->\tz = y * 2" in out.stdout, out.stdout  # l
    assert "<worker1 cell" in out.stdout  # w names the cell's frame
    assert "rpcnb" not in out.stdout, out.stdout  # none of rpcnb's frames
    assert out.text == "202"  # c let the cell finish


def test_q_ends_the_cell_with_a_message_and_keeps_the_namespace(group):
    out = group.execute("%%remote worker1\nkept_before = 1\nbreakpoint()\nnever = 2",
                        answers=["q"], allow_error=True)
    assert "BdbQuit" in out.traceback and "quit" in out.traceback
    assert group.execute("%%remote worker1 --fetch\n"
                         "(kept_before, 'never' in globals())").text == "(1, False)"


def test_an_interrupt_at_the_pdb_prompt_ends_the_session_and_the_cell(group):
    out = group.execute("%%remote worker1\nbefore_interrupt = 5\nbreakpoint()\nafter = 6",
                        answers=lambda prompt: None, allow_error=True, timeout=60)
    assert out.prompts and "KeyboardInterrupt" in out.traceback
    assert group.execute("%%remote worker1 --fetch\n"
                         "(before_interrupt, 'after' in globals())").text == "(5, False)"
    # the next cell runs plainly, no debugger left tracing it
    assert group.execute("%%remote worker1 --fetch\nsum(range(4))").text == "6"


def test_pythonbreakpoint_0_is_honoured(group):
    out = group.execute("%%remote worker2 --fetch\nimport os\n"
                        "os.environ['PYTHONBREAKPOINT'] = '0'\nbreakpoint()\n"
                        "del os.environ['PYTHONBREAKPOINT']\n'ran through'")
    assert out.prompts == [] and out.text == "'ran through'"


def test_pdb_set_trace_in_a_function_called_with_rpc_sync(group):
    group.execute("def traced(a):\n    import pdb\n    b = a + 1\n    pdb.set_trace()\n"
                  "    return b * 10")
    out = group.execute("import torch.distributed.rpc as rpc\nrpc.rpc_sync('worker1', traced, "
                        "args=(4,))", answers=["p b", "c"])
    assert [p for p, _ in out.prompts] == ["[worker1] (Pdb) "] * 2
    assert "[worker1] 5" in out.stdout.splitlines(), out.stdout  # a call's output: named
    assert out.text == "50"


def test_breakpoints_on_all_workers_get_a_session_each(group):
    code = "import os\nme = os.environ.get('RPCNB_NAME', '')\nbreakpoint()\ndone = True"
    out = group.execute("%%remote --all\n" + code, answers=["c", "c"])
    assert sorted(p for p, _ in out.prompts) == ["[worker1] (Pdb) ", "[worker2] (Pdb) "]
    assert group.execute("%%remote --all --fetch\ndone").text.count("True") == 2


def test_debug_after_a_three_deep_failure_opens_the_workers_frames(group):
    failed = group.execute("%%remote worker1\n" + DEEP, allow_error=True)
    assert "ZeroDivisionError" in failed.traceback
    out = group.execute("%debug", answers=["p y", "p x", "up", "p x", "up", "p local_here",
                                           "w", "q"])
    assert [p for p, _ in out.prompts] == ["[worker1] (Pdb) "] * 8
    lines = out.stdout.splitlines()
    # inner's y and x, middle's x, outer's local
    assert lines[1:] and [ln for ln in lines if ln in ("82", "41", "40", "'kept'")] == \
        ["82", "41", "40", "'kept'"], out.stdout
    assert "-> return y / 0" in out.stdout
    assert "rpcnb" not in out.stdout, out.stdout  # w: the cell's frames only


def test_debug_worker_picks_a_member_after_a_failed_all_cell(group):
    code = "import os\nrank_value = {'worker1': 1, 'worker2': 2}[os.environ.get('X', 'worker1')]\n" \
           "def boom(v):\n    mine = v * 10\n    raise ValueError(mine)\nboom(rank_value)"
    group.execute("%%remote worker2\nimport os\nos.environ['X'] = 'worker2'")
    failed = group.execute("%%remote --all\n" + code, allow_error=True)
    assert "worker1" in failed.traceback and "worker2" in failed.traceback
    out = group.execute("%debug worker2", answers=["p mine", "q"])
    assert out.prompts[0][0] == "[worker2] (Pdb) "
    assert "20" in out.stdout.splitlines(), out.stdout
    group.execute("%%remote worker2\ndel os.environ['X']")


def test_pdb_on_opens_the_debugger_by_itself(group):
    group.execute("%pdb on")
    try:
        out = group.execute("%%remote worker2\nvalue_at_failure = 7\nvalue_at_failure / 0",
                            answers=["p value_at_failure", "q"], allow_error=True)
        assert [p for p, _ in out.prompts] == ["[worker2] (Pdb) "] * 2
        assert "7" in out.stdout.splitlines(), out.stdout
    finally:
        group.execute("%pdb off")


def test_debug_after_a_failed_rpc_sync_debugs_on_the_worker(group):
    group.execute("def fails_there(n):\n    half = n / 2\n    return half / 0")
    failed = group.execute("import torch.distributed.rpc as rpc\n"
                           "rpc.rpc_sync('worker1', fails_there, args=(8,))", allow_error=True)
    assert "ZeroDivisionError" in failed.traceback
    out = group.execute("%debug", answers=["p half", "q"])
    assert out.prompts and out.prompts[0][0] == "[worker1] (Pdb) "
    assert "4.0" in out.stdout.splitlines(), out.stdout


def test_a_local_debug_behaves_as_before(group):
    group.execute("def local_fail():\n    here_only = 3\n    return here_only / 0")
    group.execute("local_fail()", allow_error=True)
    out = group.execute("%debug", answers=["p here_only", "q"])
    assert out.prompts and "[worker" not in out.prompts[0][0]
    assert "3" in out.stdout.splitlines(), out.stdout


@pytest.mark.serial  # how soon the cell is said to wait
def test_a_queued_cell_interrupted_before_it_ran_says_it_never_ran(group):
    group.execute("%%remote worker1 --bg -o h\nimport time\ntime.sleep(20)")
    t0 = time.monotonic()
    out = group.execute("%%remote worker1\nnever_ran_here = 1", interrupt_after=1.5,
                        allow_error=True, timeout=30)
    assert time.monotonic() - t0 < 5  # not the grace of a running cell
    assert "never ran" in out.stderr, out.stderr
    assert "still running" not in out.traceback + out.stderr
    group.execute("h.cancel()")
    assert group.execute("%%remote worker1 --fetch\n'never_ran_here' in globals()").text == "False"


@pytest.mark.serial  # how soon the next cell says it waits
def test_a_cell_that_swallows_the_interrupt_is_said_to_run_on(group):
    code = ("import time\nfor _ in range(2):\n    try:\n        time.sleep(8)\n"
            "    except KeyboardInterrupt:\n        print('caught it, going on', flush=True)\n"
            "swallowed = True")
    out = group.execute("%%remote worker2\n" + code, interrupt_after=1.0, allow_error=True,
                        timeout=60)
    assert "KeyboardInterrupt" in out.traceback
    assert "still running there" in out.traceback and "%rpc_restart worker2" in out.traceback
    # the next cell to it says within a second that it waits, and what to do
    nxt = group.execute("%%remote worker2 --fetch\nswallowed", timeout=60)
    said = [t for t, kind, text in nxt.events if kind == "stderr" and "still busy" in text]
    assert said and said[0] - nxt.started < 1.5, nxt.stderr
    assert "%rpc_restart worker2" in nxt.stderr
    assert nxt.text == "True"
