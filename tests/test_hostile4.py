"""What the third hostile round (issue 26) left: a .gz bomb under a container's memory limit, ranks of a user's
loop that part ways (one leaves, one reads more, one sleeps), a rendezvous that does not add up, and the processes a
user's script starts. Everything that runs ranks runs in a child process with a time limit, so a regression fails
instead of hanging the suite."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import zlib

import pytest

from conftest import ROOT
from multicard.data import headroom, idx
from multicard.errors import UsageError


# -- memory ----------------------------------------------------------------------------------------------------
def gz_bomb(path, items: int = idx.MAX_ITEMS, zeros: int = 64 << 20) -> None:
    """A few hundred KB that claim `items` images and expand to `zeros` bytes of zeros (and would go on)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    with open(path, "wb") as f:
        f.write(z.compress((2051).to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in (items, 28, 28))))
        for _ in range(zeros >> 20):
            f.write(z.compress(bytes(1 << 20)))
        f.write(z.flush())


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_gz_bomb_under_a_containers_memory_limit_is_one_line_before_reading(tmp_path, monkeypatch, version):
    """The machine has room for the header's 15 GB, the process's control group (a container, systemd-run -p
    MemoryMax=4G) has not: refused from the group's limit, not read into the out-of-memory killer."""
    path = tmp_path / "train-images-idx3-ubyte.gz"
    gz_bomb(path)
    cgroup, own = tmp_path / "cgroup", "system.slice/job.scope"
    sub, limit, used, line = (("", "memory.max", "memory.current", f"0::/{own}") if version == "v2" else
                              ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", f"4:memory:/{own}"))
    (cgroup / sub / own).mkdir(parents=True)
    (cgroup / sub / "system.slice" / limit).write_text(f"{4 << 30}\n")  # the limit is on a parent group
    (cgroup / sub / "system.slice" / used).write_text(f"{1 << 30}\n")
    (cgroup / sub / own / limit).write_text("max\n" if version == "v2" else f"{(1 << 63) - 4096}\n")
    (cgroup / sub / own / used).write_text(f"{1 << 29}\n")
    (tmp_path / "self").write_text(f"1:name=systemd:/\n{line}\n")
    monkeypatch.setattr(headroom, "CGROUP", cgroup)
    monkeypatch.setattr(headroom, "SELF", tmp_path / "self")
    monkeypatch.setattr(headroom, "machine", lambda: 64 << 30)
    assert headroom.available_memory() == 3 << 30
    with pytest.raises(UsageError, match=r"its header \(4000000, 28, 28\) needs 14.60 GiB of memory once read, "
                                         r"more than the 3.00 GiB available"):
        idx.read_idx(path, idx.IMAGES_MAGIC)


def test_a_gz_bomb_under_ulimit_v_is_one_line(tmp_path):
    """Under an address-space limit (ulimit -v) the header's need is weighed against what the limit leaves."""
    gz_bomb(tmp_path / "images.gz", items=1_000_000, zeros=8 << 20)
    code = textwrap.dedent("""
        import resource, sys
        from multicard.data import idx
        from multicard.errors import UsageError
        vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize:")).split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.RLIM_INFINITY))
        try:
            idx.read_idx(sys.argv[1], idx.IMAGES_MAGIC)
        except UsageError as e:
            print(e)
    """)
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "images.gz")], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert re.fullmatch(r".*images.gz: its header \(1000000, 28, 28\) needs 3.65 GiB of memory once read, more than "
                        r"the [12]\.\d\d GiB available\n", done.stdout), done.stdout + done.stderr
