"""Data: IDX validation on small generated files (a .gz whose header claims more than the memory, a container's limit or
ulimit -v leaves is refused before reading), the embedded mnist-5k split, ImageData, synthetic data, and the checksummed
download (served from memory: no test touches the network)."""

from __future__ import annotations

import gzip
import hashlib
import http.client
import io
import re
import subprocess
import sys
import textwrap
import tracemalloc
import urllib.error
import urllib.request
import zlib
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import RandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from conftest import HUNG_S, ROOT
from multicard import data
from multicard.data import headroom, idx, mnist5k, synthetic
from multicard.data.images import ImageData
from multicard.data.order import GlobalOrder, Permutation
from multicard.errors import UsageError
from multicard.trainer.config import TrainConfig

TRAIN_IMAGES, TRAIN_LABELS = idx.SPLITS["train"]
TEST_IMAGES, TEST_LABELS = idx.SPLITS["test"]
FILES = (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any real download attempt fails the test loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a test tried to reach the network: {args}")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


# -- writing IDX files -------------------------------------------------------------------------------------

def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """The IDX encoding of a uint8 array: magic (0x0801 + dims), one big-endian uint32 per dimension, data."""
    magic = (0x0800 + array.ndim) if magic is None else magic
    head = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return head + array.astype(np.uint8).tobytes()


def header(magic: int, *shape: int) -> bytes:
    """An IDX header alone, for any claimed shape (idx_bytes would need the array that shape describes)."""
    return magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in shape)


def write(path: Path, raw: bytes, gz: bool = False) -> Path:
    path = path.with_name(path.name + ".gz") if gz else path
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def write_mnist(folder: Path, n_train: int = 20, n_test: int = 10, gz: bool = False, seed: int = 0) -> dict:
    """The four standard MNIST files with n_train / n_test random images and labels; returns the arrays."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {}
    for (images_name, labels_name), n in ((idx.SPLITS["train"], n_train), (idx.SPLITS["test"], n_test)):
        arrays[images_name] = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        arrays[labels_name] = (np.arange(n) % 10).astype(np.uint8)[rng.permutation(n)]
    for name, array in arrays.items():
        write(folder / name, idx_bytes(array), gz)
    return arrays


def path_of(folder: Path, stem: str) -> Path:
    found = idx.find(folder, stem)
    assert found is not None
    return found


@contextmanager
def peak_memory():
    """Yields a list that holds, once the block ends, the most memory Python and numpy had allocated in it."""
    peak = []
    tracemalloc.start()
    try:
        yield peak
        peak.append(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def load_error(folder: Path) -> str:
    with pytest.raises(UsageError) as e:
        idx.load("mnist", str(folder), download=False)
    message = str(e.value)
    assert "\n" not in message
    return message


# -- good files ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_good_files_load(tmp_path, gz):
    arrays = write_mnist(tmp_path, 20, 10, gz=gz)
    train, test = idx.load("mnist", str(tmp_path), download=False)
    assert isinstance(train, ImageData) and isinstance(test, ImageData)
    assert len(train) == 20 and len(test) == 10
    for split, images_name, labels_name in ((train, TRAIN_IMAGES, TRAIN_LABELS), (test, TEST_IMAGES, TEST_LABELS)):
        images, labels = split.tensors
        assert images.dtype == torch.float32 and images.shape == (len(split), 1, 28, 28)
        assert labels.dtype == torch.int64 and labels.shape == (len(split),)
        pixels = torch.from_numpy(arrays[images_name]).float()
        assert torch.allclose(images[:, 0], (pixels / 255 - 0.1307) / 0.3081)
        assert torch.equal(labels, torch.from_numpy(arrays[labels_name].astype(np.int64)))
    assert (train.mean, train.std) == (0.1307, 0.3081)
    assert not train.augment and not test.augment


def test_data_load_by_name_uses_each_datasets_normalization(tmp_path):
    write_mnist(tmp_path, 10, 10)
    mnist_train, _ = data.load("mnist", str(tmp_path))
    fashion_train, fashion_test = data.load("fashion-mnist", str(tmp_path), augment=True)
    assert (fashion_train.mean, fashion_train.std) == (0.2860, 0.3530)
    assert fashion_train.augment and not fashion_test.augment  # augmentation is for training only
    pixels = mnist_train.tensors[0] * 0.3081 + 0.1307  # the same files, each normalized its own way
    assert torch.allclose(fashion_train.tensors[0], (pixels - 0.2860) / 0.3530, atol=1e-5)


def test_mixed_plain_and_gz_files_load(tmp_path):
    arrays = write_mnist(tmp_path, 12, 10, gz=True)
    (tmp_path / (TRAIN_LABELS + ".gz")).unlink()
    write(tmp_path / TRAIN_LABELS, idx_bytes(arrays[TRAIN_LABELS]))
    train, _ = idx.load("mnist", str(tmp_path), download=False)
    assert torch.equal(train.tensors[1], torch.from_numpy(arrays[TRAIN_LABELS].astype(np.int64)))


def test_zero_images_is_not_an_error(tmp_path):
    write_mnist(tmp_path, 0, 10)
    train, test = idx.load("mnist", str(tmp_path), download=False)
    assert len(train) == 0 and len(test) == 10


# -- bad files: one line, naming the file ----------------------------------------------------------------------

@pytest.mark.parametrize("stem", FILES)
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_bad_magic(tmp_path, stem, gz):
    arrays = write_mnist(tmp_path, gz=gz)
    wrong = idx.LABELS_MAGIC if "images" in stem else idx.IMAGES_MAGIC
    write(tmp_path / stem, idx_bytes(arrays[stem], magic=wrong), gz)
    message = load_error(tmp_path)
    assert str(path_of(tmp_path, stem)) in message
    assert "magic" in message and str(wrong) in message


@pytest.mark.parametrize("stem", FILES)
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_truncated_file(tmp_path, stem, gz):
    arrays = write_mnist(tmp_path, gz=gz)
    raw = idx_bytes(arrays[stem])
    path = write(tmp_path / stem, raw[:-5], gz)
    message = load_error(tmp_path)
    assert str(path) in message
    assert f"size {len(raw) - 5} bytes" in message and f"needs exactly {len(raw)}" in message


@pytest.mark.parametrize("stem", FILES)
def test_shorter_than_header(tmp_path, stem):
    write_mnist(tmp_path)
    write(tmp_path / stem, b"\x00\x00\x08")
    message = load_error(tmp_path)
    assert str(tmp_path / stem) in message and "truncated" in message


@pytest.mark.parametrize("stem", FILES)
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_extra_bytes(tmp_path, stem, gz):
    arrays = write_mnist(tmp_path, gz=gz)
    raw = idx_bytes(arrays[stem]) + b"\x00\x01\x02"
    path = write(tmp_path / stem, raw, gz)
    message = load_error(tmp_path)
    assert str(path) in message
    assert f"size {len(raw)} bytes" in message and f"needs exactly {len(raw) - 3}" in message


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_images_not_28x28_are_refused_from_the_header_alone(tmp_path, gz):
    write_mnist(tmp_path, gz=gz)
    huge = 2**32 - 1  # 16 EB of pixels claimed by 17 bytes
    path = write(tmp_path / TRAIN_IMAGES, header(idx.IMAGES_MAGIC, 10, huge, huge) + b"x", gz)
    with peak_memory() as peak:
        message = load_error(tmp_path)
    assert str(path) in message and f"images are {huge}x{huge}, expected 28x28" in message
    assert peak[0] < 1 << 20


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
@pytest.mark.parametrize("stem, count", [(TRAIN_IMAGES, 2**32 - 1), (TEST_LABELS, 2**32 - 1),
                                         (TRAIN_IMAGES, idx.MAX_ITEMS + 1), (TRAIN_LABELS, idx.MAX_ITEMS + 1)])
def test_a_huge_count_is_refused_from_the_header_alone(tmp_path, stem, count, gz):
    write_mnist(tmp_path, gz=gz)
    kind, magic, shape = (("images", idx.IMAGES_MAGIC, (count, 28, 28)) if "images" in stem
                          else ("labels", idx.LABELS_MAGIC, (count,)))
    path = write(tmp_path / stem, header(magic, *shape) + bytes(100), gz)
    with peak_memory() as peak:
        message = load_error(tmp_path)
    assert str(path) in message
    assert f"header claims {count} {kind}, more than the {idx.MAX_ITEMS} this reader takes" in message
    assert peak[0] < 1 << 20  # nothing the size of the claim was allocated


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_the_largest_count_passes_the_header_and_is_then_held_to_its_size(tmp_path, gz):
    path = write(tmp_path / TRAIN_LABELS, header(idx.LABELS_MAGIC, idx.MAX_ITEMS) + b"\x01\x02\x03", gz)
    with pytest.raises(UsageError) as e:
        idx.read_idx(path, idx.LABELS_MAGIC)
    assert f"size 11 bytes, but its header ({idx.MAX_ITEMS},) needs exactly {idx.MAX_ITEMS + 8}" in str(e.value)


def test_gz_bomb_is_refused_without_expanding_it(tmp_path):
    arrays = write_mnist(tmp_path, gz=True)
    valid = idx_bytes(arrays[TRAIN_IMAGES])
    bomb, zeros = tmp_path / (TRAIN_IMAGES + ".gz"), bytes(1 << 20)
    pack = zlib.compressobj(1, zlib.DEFLATED, 31)  # wbits 31: gzip framing; level 1: fastest to build
    with open(bomb, "wb") as f:  # a valid file, then 200 MiB of zeros, packed as it goes: never 200 MiB here
        f.write(pack.compress(valid))
        for _ in range(200):
            f.write(pack.compress(zeros))
        f.write(pack.flush())
    assert bomb.stat().st_size < 2 << 20
    with peak_memory() as peak:
        message = load_error(tmp_path)
    assert str(bomb) in message
    assert f"size at least {len(valid) + idx.LEFTOVER} bytes, but its header (20, 28, 28) needs exactly " \
           f"{len(valid)}" in message
    assert peak[0] < 8 << 20  # what the header promises plus a read chunk: not the 200 MiB it expands to


def test_no_memory_for_the_claimed_shape_is_one_line(tmp_path, monkeypatch):
    path = write(tmp_path / TRAIN_LABELS, idx_bytes(np.zeros(10, np.uint8)), gz=True)

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(np, "empty", no_memory)
    with pytest.raises(UsageError, match=r"header \(10,\) needs 18 bytes of memory, more than this machine gives"):
        idx.read_idx(path, idx.LABELS_MAGIC)


def test_a_gz_whose_header_claims_more_than_memory_is_refused_before_reading(tmp_path, monkeypatch):
    path = tmp_path / "train-images-idx3-ubyte.gz"
    images = np.zeros((1000, 28, 28), np.uint8)
    path.write_bytes(gzip.compress((2051).to_bytes(4, "big") + b"".join(n.to_bytes(4, "big") for n in images.shape)
                                   + images.tobytes()))
    monkeypatch.setattr(idx, "available_memory", lambda: 1 << 20)
    read = []
    monkeypatch.setattr(np, "empty", lambda *a, **k: read.append(a) or np.zeros(*a, **k))
    with pytest.raises(UsageError, match=r"its header \(1000, 28, 28\) needs 0.00 GiB of memory once read, more than "
                                         r"the 0.00 GiB available"):
        idx.read_idx(path, idx.IMAGES_MAGIC)
    assert read == []  # refused before anything was allocated
    monkeypatch.setattr(idx, "available_memory", lambda: 1 << 30)
    assert idx.read_idx(path, idx.IMAGES_MAGIC).shape == (1000, 28, 28)


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
                          timeout=HUNG_S, cwd=ROOT)
    assert re.fullmatch(r".*images.gz: its header \(1000000, 28, 28\) needs 3.65 GiB of memory once read, more than "
                        r"the [12]\.\d\d GiB available\n", done.stdout), done.stdout + done.stderr


@pytest.mark.parametrize("split", ["train", "test"])
def test_count_mismatch(tmp_path, split):
    images_name, labels_name = idx.SPLITS[split]
    arrays = write_mnist(tmp_path, 20, 10)
    write(tmp_path / labels_name, idx_bytes(arrays[labels_name][:-1]))
    message = load_error(tmp_path)
    n = len(arrays[images_name])
    assert str(tmp_path / labels_name) in message and str(tmp_path / images_name) in message
    assert f"{n - 1} labels for {n} images" in message


@pytest.mark.parametrize("stem", [TRAIN_LABELS, TEST_LABELS])
def test_label_out_of_range(tmp_path, stem):
    arrays = write_mnist(tmp_path)
    labels = arrays[stem].copy()
    labels[3] = 10
    write(tmp_path / stem, idx_bytes(labels))
    message = load_error(tmp_path)
    assert str(tmp_path / stem) in message and "label 10" in message


def test_images_not_28x28(tmp_path):  # the whole file is valid IDX, just not MNIST
    write_mnist(tmp_path)
    write(tmp_path / TEST_IMAGES, idx_bytes(np.zeros((10, 32, 32), np.uint8)))
    message = load_error(tmp_path)
    assert str(tmp_path / TEST_IMAGES) in message and "32x32" in message


@pytest.mark.parametrize("damage", ["cut", "flipped", "header"])
def test_damaged_gzip(tmp_path, damage):
    arrays = write_mnist(tmp_path, gz=True)
    packed = gzip.compress(idx_bytes(arrays[TRAIN_IMAGES]))
    if damage == "cut":
        packed = packed[: len(packed) // 2]
    elif damage == "flipped":  # a broken deflate stream (zlib.error, not an OSError)
        packed = packed[:10] + bytes(b ^ 0xFF for b in packed[10:-8]) + packed[-8:]
    else:
        packed = packed[:2] + b"\x00" * 8 + packed[10:]
    (tmp_path / (TRAIN_IMAGES + ".gz")).write_bytes(packed)
    message = load_error(tmp_path)
    assert str(tmp_path / (TRAIN_IMAGES + ".gz")) in message


# -- missing files ---------------------------------------------------------------------------------------------

def test_missing_files_without_download(tmp_path):
    message = load_error(tmp_path)
    assert all(stem in message for stem in FILES)
    assert str(tmp_path) in message and "--download" in message


def test_one_missing_file_is_named_alone(tmp_path):
    write_mnist(tmp_path, gz=True)
    (tmp_path / (TEST_LABELS + ".gz")).unlink()
    message = load_error(tmp_path)
    assert TEST_LABELS in message and "--download" in message and str(tmp_path) in message
    assert all(stem not in message for stem in FILES if stem != TEST_LABELS)


def test_data_dir_that_does_not_exist(tmp_path):
    with pytest.raises(UsageError, match="no such folder"):
        idx.load("mnist", str(tmp_path / "nowhere"), download=False)


def test_missing_files_in_cache_without_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MULTICARD_CACHE", str(tmp_path))
    with pytest.raises(UsageError) as e:
        data.load("fashion-mnist")
    assert str(tmp_path / "multicard" / "fashion-mnist") in str(e.value) and "--download" in str(e.value)


def test_unknown_dataset_name():
    with pytest.raises(UsageError, match="--data nope: unknown; choose one of mnist-5k"):
        data.load("nope")


# -- download, served from memory ------------------------------------------------------------------------------

class Server:
    """Stands in for urllib.request.urlopen: serves bytes by URL, fails for anything else, records calls."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.calls = files, []

    def __call__(self, url, timeout=None):
        self.calls.append(url)
        if url not in self.files:
            raise urllib.error.URLError(f"no route to {url}")
        return io.BytesIO(self.files[url])


def gz_files(n_train: int = 20, n_test: int = 10) -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    arrays = {TRAIN_IMAGES: rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              TRAIN_LABELS: (np.arange(n_train) % 10).astype(np.uint8),
              TEST_IMAGES: rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
              TEST_LABELS: (np.arange(n_test) % 10).astype(np.uint8)}
    return {stem: gzip.compress(idx_bytes(a), mtime=0) for stem, a in arrays.items()}


def md5(raw: bytes) -> str:
    return hashlib.md5(raw).hexdigest()


def test_fetch_keeps_files_whose_md5_matches(tmp_path, monkeypatch):
    packed = gz_files()
    server = Server({"https://mirror.test/" + stem + ".gz": raw for stem, raw in packed.items()})
    monkeypatch.setattr(urllib.request, "urlopen", server)
    folder = tmp_path / "cache"
    idx.fetch(folder, ("https://mirror.test/",), {stem: md5(raw) for stem, raw in packed.items()})
    assert sorted(p.name for p in folder.iterdir()) == sorted(stem + ".gz" for stem in FILES)
    for stem, raw in packed.items():
        assert (folder / (stem + ".gz")).read_bytes() == raw
    train, test = idx.load("mnist", str(folder), download=False)
    assert len(train) == 20 and len(test) == 10


def test_fetch_rejects_a_wrong_md5_and_leaves_nothing(tmp_path, monkeypatch):
    packed = gz_files()
    server = Server({"https://mirror.test/" + stem + ".gz": raw for stem, raw in packed.items()})
    monkeypatch.setattr(urllib.request, "urlopen", server)
    md5s = {stem: md5(raw) for stem, raw in packed.items()}
    md5s[TRAIN_IMAGES] = "0" * 32
    with pytest.raises(UsageError) as e:
        idx.fetch(tmp_path, ("https://mirror.test/",), md5s)
    message = str(e.value)
    assert TRAIN_IMAGES + ".gz" in message and "md5" in message and md5(packed[TRAIN_IMAGES]) in message
    assert not (tmp_path / (TRAIN_IMAGES + ".gz")).exists()
    assert not list(tmp_path.glob("*.part"))


def test_fetch_tries_the_next_mirror(tmp_path, monkeypatch):
    packed = gz_files()
    files = {"https://good.test/" + stem + ".gz": raw for stem, raw in packed.items()}
    files["https://bad.test/" + TRAIN_LABELS + ".gz"] = b"not the file"  # wrong md5 on the first mirror
    server = Server(files)
    monkeypatch.setattr(urllib.request, "urlopen", server)
    idx.fetch(tmp_path, ("https://bad.test/", "https://good.test/"), {s: md5(r) for s, r in packed.items()})
    assert all((tmp_path / (stem + ".gz")).read_bytes() == packed[stem] for stem in FILES)
    assert "https://bad.test/" + TRAIN_LABELS + ".gz" in server.calls
    assert not list(tmp_path.glob("*.part"))


def test_fetch_all_mirrors_down(tmp_path, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", Server({}))
    with pytest.raises(UsageError, match="download of train-images-idx3-ubyte.gz failed: https://a.test/"):
        idx.fetch(tmp_path, ("https://a.test/",), {stem: "0" * 32 for stem in FILES})
    assert list(tmp_path.iterdir()) == []


class CutOff(io.BytesIO):
    """A response whose connection breaks after the first chunk: `error` is raised by the second read."""

    def __init__(self, raw: bytes, error: BaseException):
        super().__init__(raw)
        self.error, self.reads = error, 0

    def read(self, n=-1):
        self.reads += 1
        if self.reads > 1:
            raise self.error
        return super().read(min(n, 100) if n and n > 0 else 100)


@pytest.mark.parametrize("error", [http.client.IncompleteRead(b"abc", 100), ConnectionResetError("reset by peer")],
                         ids=["IncompleteRead", "ConnectionReset"])
def test_fetch_after_a_cut_connection_tries_the_next_mirror(tmp_path, monkeypatch, error):
    packed = gz_files()
    good = Server({"https://good.test/" + stem + ".gz": raw for stem, raw in packed.items()})
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout=None: CutOff(packed[TRAIN_IMAGES], error)
                        if url.startswith("https://cut.test/") else good(url, timeout))
    idx.fetch(tmp_path, ("https://cut.test/", "https://good.test/"), {s: md5(r) for s, r in packed.items()})
    assert all((tmp_path / (stem + ".gz")).read_bytes() == packed[stem] for stem in FILES)
    assert not list(tmp_path.glob("*.part"))


def test_fetch_cut_everywhere_is_one_error_and_no_part_file(tmp_path, monkeypatch):
    packed = gz_files()
    monkeypatch.setattr(urllib.request, "urlopen",
                        lambda url, timeout=None: CutOff(packed[TRAIN_IMAGES], http.client.IncompleteRead(b"", 9)))
    with pytest.raises(UsageError, match="download of train-images-idx3-ubyte.gz failed: https://cut.test/"):
        idx.fetch(tmp_path, ("https://cut.test/",), {s: md5(r) for s, r in packed.items()})
    assert list(tmp_path.iterdir()) == []


def test_fetch_interrupted_leaves_no_part_file(tmp_path, monkeypatch):
    packed = gz_files()
    monkeypatch.setattr(urllib.request, "urlopen",
                        lambda url, timeout=None: CutOff(packed[TRAIN_IMAGES], KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        idx.fetch(tmp_path, ("https://slow.test/",), {s: md5(r) for s, r in packed.items()})
    assert list(tmp_path.iterdir()) == []


def test_fetch_downloads_only_missing_files(tmp_path, monkeypatch):
    packed = gz_files()
    for stem in (TRAIN_IMAGES, TRAIN_LABELS):
        (tmp_path / (stem + ".gz")).write_bytes(packed[stem])
    server = Server({"https://m.test/" + stem + ".gz": raw for stem, raw in packed.items()})
    monkeypatch.setattr(urllib.request, "urlopen", server)
    idx.fetch(tmp_path, ("https://m.test/",), {s: md5(r) for s, r in packed.items()})
    assert sorted(server.calls) == sorted("https://m.test/" + s + ".gz" for s in (TEST_IMAGES, TEST_LABELS))


def test_load_with_download_fills_the_cache(tmp_path, monkeypatch):
    packed = gz_files(30, 10)
    mirrors, _, mean, std = idx.SOURCES["mnist"]
    monkeypatch.setitem(idx.SOURCES, "mnist", (mirrors, {s: md5(r) for s, r in packed.items()}, mean, std))
    server = Server({mirrors[0] + stem + ".gz": raw for stem, raw in packed.items()})
    monkeypatch.setattr(urllib.request, "urlopen", server)
    monkeypatch.setenv("MULTICARD_CACHE", str(tmp_path))
    train, test = data.load("mnist", download=True)
    assert len(train) == 30 and len(test) == 10
    assert len(server.calls) == 4
    train, _ = data.load("mnist", download=True)  # now cached: nothing fetched again
    assert len(server.calls) == 4 and len(train) == 30


# -- mnist-5k --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mnist_5k():
    return mnist5k.load(), mnist5k.load()


def test_mnist_5k_split(mnist_5k):
    (train, test), _ = mnist_5k
    assert len(train) == 4000 and len(test) == 1000
    assert train.tensors[0].shape == (4000, 1, 28, 28) and train.tensors[0].dtype == torch.float32
    assert torch.bincount(train.tensors[1], minlength=10).tolist() == [400] * 10
    assert torch.bincount(test.tensors[1], minlength=10).tolist() == [100] * 10


def test_mnist_5k_is_the_same_on_every_load(mnist_5k):
    (train_a, test_a), (train_b, test_b) = mnist_5k
    for a, b in ((train_a, train_b), (test_a, test_b)):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors, strict=True))


def test_mnist_5k_train_and_test_are_disjoint(mnist_5k):
    (train, test), _ = mnist_5k
    rows = {bytes(x.numpy()) for x in train.tensors[0].flatten(1)}
    assert not any(bytes(x.numpy()) in rows for x in test.tensors[0].flatten(1))


def test_stratified_split_indices():
    labels = np.repeat(np.arange(3), [7, 5, 6])
    train, test = mnist5k.stratified_split(labels, test_per_class=2)
    assert len(set(train) | set(test)) == len(labels) and not set(train) & set(test)
    assert np.bincount(labels[test]).tolist() == [2, 2, 2]


# -- ImageData and synthetic data ------------------------------------------------------------------------------

def small_images(n: int = 8, augment: bool = False) -> ImageData:
    g = torch.Generator().manual_seed(3)
    images = torch.randint(0, 256, (n, 1, 28, 28), dtype=torch.uint8, generator=g)
    return ImageData(images, torch.arange(n) % 10, 0.5, 0.25, augment)


def test_image_data_returns_a_normalized_float_batch():
    g = torch.Generator().manual_seed(3)
    pixels = torch.randint(0, 256, (10, 1, 28, 28), dtype=torch.uint8, generator=g)
    d = ImageData(pixels, torch.arange(10) % 10, 0.5, 0.25)
    x, y = d[[0, 2, 5]]
    assert x.dtype == torch.float32 and x.shape == (3, 1, 28, 28)
    assert torch.allclose(x, (pixels[[0, 2, 5]].float() / 255 - 0.5) / 0.25)
    assert y.tolist() == [0, 2, 5]
    assert ImageData(x, y, 0.5, 0.25).tensors[0] is x  # float images are taken as normalized: not twice


def test_augmentation_changes_images_but_keeps_shape():
    plain, augmented = small_images(), small_images(augment=True)
    torch.manual_seed(0)
    x_plain, y_plain = plain[list(range(8))]
    x_aug, y_aug = augmented[list(range(8))]
    assert x_aug.shape == x_plain.shape and x_aug.dtype == torch.float32
    assert torch.equal(y_aug, y_plain)
    assert not torch.allclose(x_aug, x_plain, atol=1e-3)
    assert all(not torch.allclose(a, b, atol=1e-3) for a, b in zip(x_aug, x_plain, strict=True))


def test_synthetic_sizes_and_repeatability():
    train, test = synthetic.load(100, test_samples=30, seed=5)
    assert len(train) == 100 and len(test) == 30
    assert train.tensors[0].shape == (100, 1, 28, 28) and int(train.tensors[1].max()) <= 9
    again, _ = synthetic.load(100, test_samples=30, seed=5)
    other, _ = synthetic.load(100, test_samples=30, seed=6)
    assert torch.equal(train.tensors[0], again.tensors[0])
    assert not torch.equal(train.tensors[0], other.tensors[0])
    shaped, _ = synthetic.load(4, shape=(3, 8, 8), classes=2, test_samples=2)
    assert shaped.tensors[0].shape == (4, 3, 8, 8) and set(shaped.tensors[1].tolist()) <= {0, 1}


def test_synthetic_by_name_and_bad_size():
    train, test = data.load("synthetic", synthetic_samples=64)
    assert len(train) == 64 and len(test) == 1024
    with pytest.raises(UsageError, match="--synthetic-samples 0"):
        data.load("synthetic", synthetic_samples=0)


def test_synthetic_samples_beyond_memory_is_one_line():
    from multicard import data

    with pytest.raises(UsageError, match=r"--synthetic-samples 1000000000000: .* GiB of memory, more than"):
        data.load("synthetic", synthetic_samples=10**12)
    assert len(data.load("synthetic", synthetic_samples=8)[0]) == 8


def test_too_many_workers_is_one_line():
    from multicard.trainer.config import TrainConfig

    with pytest.raises(UsageError, match=r"--workers 100000: at most \d+ DataLoader worker processes"):
        TrainConfig(workers=100000).validate()
    TrainConfig(workers=4).validate()


@pytest.mark.parametrize("size, world", [(1, 1), (7, 1), (10, 3), (2, 5), (64, 4), (1000, 3)])
def test_training_order_deals_out_the_plain_loaders_permutation_padded_as_distributed_sampler_pads(size, world):
    for rank in range(world):
        ours, plain = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        shuffled, unshuffled = GlobalOrder(size, rank, world, Permutation(size, ours)), GlobalOrder(size, rank, world)
        for _ in range(3):  # passes draw on from the same generator, as a plain RandomSampler's do
            order = list(RandomSampler(range(size), generator=plain))
            assert list(shuffled) == (order * world)[: -(-size // world) * world][rank::world]
            assert unshuffled.order().tolist() == list(DistributedSampler(range(size), world, rank, shuffle=False))
            assert len(shuffled) == len(DistributedSampler(range(size), world, rank))
        assert ours.get_state().equal(plain.get_state())


def test_auto_device_data_holds_what_fits_in_a_quarter_of_the_cards_free_memory():
    from multicard.data.loaders import on_card

    data = TensorDataset(torch.zeros(1000, 256), torch.zeros(1000, dtype=torch.int64)).tensors  # 1,032,000 bytes
    card = torch.device("cuda", 0)  # only named: the free memory is given, CUDA is never asked
    assert on_card(data, card, free=4 * 1_032_000) == (True, "")
    fits, why = on_card(data, card, free=4 * 1_032_000 - 4)
    assert not fits and "more than a quarter of cuda:0's free memory" in why and "--device-data" in why
    assert on_card(data, torch.device("cpu")) == (False, "")  # on the CPU the data is in memory already


@pytest.mark.parametrize("free, held", [(10**9, True), (10**6, False)])
def test_the_trainer_holds_train_and_test_sets_on_a_card_when_both_fit(monkeypatch, capsys, free, held):
    import types

    from multicard.trainer.run import held_on_device

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 2 * free))  # a card, as CUDA would say
    card = types.SimpleNamespace(device=torch.device("cuda", 0), is_main=True)
    train, test = TensorDataset(torch.zeros(400, 784)), TensorDataset(torch.zeros(100, 784))  # 1.5 MB together
    config = TrainConfig()
    assert held_on_device(train, test, config, card) is held
    assert ("the data (1.5 MB) is more than a quarter" in capsys.readouterr().out) is not held
    assert held_on_device(train, test, replace(config, device_data=False), card) is False  # as given
    assert held_on_device(train, None, config, types.SimpleNamespace(device=torch.device("cpu"))) is False


def test_a_users_loader_takes_device_data_auto(monkeypatch):
    from torch.utils.data import DataLoader

    from multicard.data.loaders import InMemory, shard

    data = TensorDataset(torch.arange(12.0).view(12, 1), torch.arange(12))
    common = dict(train=True, rank=0, world=1, local_batch=lambda batch, k: batch)
    on_cpu = shard(DataLoader(data, 4), device=torch.device("cpu"), device_data="auto", **common)
    assert isinstance(on_cpu.inner, InMemory) and [len(y) for _, y in on_cpu] == [4, 4, 4]
    moved = []  # on a card with room: the tensors go there once (the move is recorded, not made)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10**9, 10**9))
    monkeypatch.setattr(torch.Tensor, "to", lambda t, device, *a, **k: moved.append(str(device)) or t)
    shard(DataLoader(data, 4), device=torch.device("cuda", 0), device_data="auto", **common)
    assert moved == ["cuda:0", "cuda:0"]
