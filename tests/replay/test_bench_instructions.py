"""``python -m urc.apps.bench.instructions``: the child drives a tree with only the measured
method counted, callgrind's totals are read, and (with valgrind) a phase is counted end to
end."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import urc
from urc.apps.bench import call_phases, instructions
from urc.apps.bench.core import generate_sequences

TREE = str(Path(urc.__file__).resolve().parents[1])
SEQS = generate_sequences(12, 16, 42)

# The head and tail of a real callgrind output file (valgrind 3.19, --cache-sim=yes).
CALLGRIND_OUT = """\
# callgrind format
version: 1
creator: callgrind-3.19.0
events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
fl=(1) ???
fn=(1) 0x0000000000001000
1 5 2 1
totals: 1000 300 200 10 40 20 5 6 4
"""


def test_callgrind_totals_are_read_by_event_name() -> None:
    ev = instructions.parse_callgrind(CALLGRIND_OUT)
    assert ev["Ir"] == 1000 and ev["D1mr"] == 40 and ev["D1mw"] == 20 and ev["DLmw"] == 4
    with pytest.raises(ValueError, match="not a callgrind output"):
        instructions.parse_callgrind("Ir 1000\n")


@pytest.mark.parametrize("phase", sorted(instructions.METHODS))
def test_the_child_runs_every_phase_and_agrees_with_the_direct_run(
    tmp_path: Path, phase: str
) -> None:
    """Without valgrind the child is plain Python: its call count and checksum are those of
    :func:`run_call_phases` on the same tree (wrapping the measured method changes nothing)."""
    args = {
        "tree": TREE,
        "call_phases": call_phases.__file__,
        "method": instructions.METHODS[phase],
        "phase": phase,
        "components": "full+mamba",
        "page_size": 4,
        "seqs": SEQS,
        "chunk_len": 16,
    }
    (tmp_path / "args.pkl").write_bytes(pickle.dumps(args))
    out = tmp_path / "out.pkl"
    cmd = [sys.executable, "-c", instructions._CHILD, str(tmp_path / "args.pkl"), str(out)]
    subprocess.run(cmd, check=True, cwd=tmp_path, timeout=300)
    got = pickle.loads(out.read_bytes())
    direct = call_phases.run_call_phases(urc, "full+mamba", 4, SEQS, 16)
    assert got == {"calls": len(direct[phase]), "checksum": direct["checksum"]}


def test_usage_errors_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        instructions.main([TREE, "--phase", "lock", "--num-seqs", "0"])
    assert e.value.code == 2 and "--num-seqs: must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        instructions.main([TREE, "--phase", "lock", "--valgrind", "no-such-valgrind"])
    assert e.value.code == 2 and "is not on PATH" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)  # importing torch under valgrind takes minutes on a busy machine
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_a_phase_is_counted_under_callgrind() -> None:
    """The marker turns collection on around the measured calls only: an insert counts
    thousands of instructions, not none (never on) and not the millions of importing torch
    (always on)."""
    cost, checksum = instructions.measure(TREE, "insert", "full", 1, SEQS, 16)
    assert cost.calls == len(SEQS) and 2_000 < cost.ir < 2_000_000, cost
    assert (
        cost.d1_misses > 0
        and checksum == call_phases.run_call_phases(urc, "full", 1, SEQS, 16)["checksum"]
    )
