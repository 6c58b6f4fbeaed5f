"""The disk kernel cache (csrc/gpu/kernel_cache.cc), tested without a GPU through a cache
object of its own (`_DiskCache`): entries written atomically and verified on every read, bad
entries of every kind discarded and rebuilt, several processes reading and writing one cache at
once, and unsafe or unwritable directories turning disk caching off with one warning. The last
tests (marked gpu) check the same through real kernel compilations."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
from cases import Case

from jaxfuse import compiled, runtime
from jaxfuse._extension import extension

ROOT = os.geteuid() == 0


def _cache(directory: Path | str) -> object:
    cache = extension()._DiskCache()
    cache.configure(str(directory))
    return cache


def _payload(key: str, size: int = 3000) -> bytes:
    """Deterministic bytes for a key (binary, with NULs and newlines)."""
    seed = sum(key.encode())
    return bytes((seed * 131 + i * 7) % 256 for i in range(size))


def _entry(directory: Path) -> Path:
    (path,) = [p for p in directory.iterdir() if p.suffix == ".jfk"]
    return path


def test_round_trip_and_permissions(tmp_path) -> None:
    directory = tmp_path / "a" / "kernels"
    cache = _cache(directory)
    assert cache.load("plan-1") is None
    assert stat.S_IMODE(directory.stat().st_mode) & 0o077 == 0  # created 0700
    data = _payload("plan-1")
    cache.store("plan-1", data)
    assert cache.load("plan-1") == data
    assert stat.S_IMODE(_entry(directory).stat().st_mode) == 0o600
    assert cache.keys() == ["plan-1"]
    assert cache.problem == ""
    cache.store("plan-2", b"")  # empty payloads are entries too
    assert cache.load("plan-2") == b""
    assert _cache(directory).load("plan-1") == data  # another cache object, same directory


def _bad_entry_cases(path: Path, good: bytes) -> dict:
    """Ways an entry can go bad: what to write at its path."""
    magic_end = good.index(b"\n") + 1
    key_line_end = good.index(b"\n", magic_end) + 1
    return {
        "truncated": lambda: path.write_bytes(good[:-100]),
        "truncated header": lambda: path.write_bytes(good[:magic_end + 3]),
        "padded": lambda: path.write_bytes(good + b"\x00"),
        "flipped payload byte": lambda: path.write_bytes(
            good[:-10] + bytes([good[-10] ^ 1]) + good[-9:]),
        "flipped checksum": lambda: path.write_bytes(_flip_checksum(good)),
        "signed size": lambda: path.write_bytes(
            good[:magic_end] + b"+" + good[magic_end:]),
        "size with spaces": lambda: path.write_bytes(
            good[:magic_end] + b" " + good[magic_end:]),
        "negative size": lambda: path.write_bytes(
            good[:magic_end] + b"-1\n" + good[key_line_end:]),
        "not a cache file": lambda: path.write_bytes(b"\x7fELF" + good[4:]),
        "empty": lambda: path.write_bytes(b""),
        "group-writable": lambda: (path.write_bytes(good), path.chmod(0o660)),
        "world-writable": lambda: (path.write_bytes(good), path.chmod(0o606)),
        "sparse 2 GiB": lambda: (path.write_bytes(good), os.truncate(path, 2 << 30)),
    }


def _flip_checksum(entry: bytes) -> bytes:
    # Layout: magic, key size, key, payload size, checksum (hex), payload; one per line.
    lines = entry.split(b"\n", 5)
    lines[4] = lines[4][:-1] + (b"1" if lines[4].endswith(b"0") else b"0")
    return b"\n".join(lines)


@pytest.mark.parametrize("kind", list(_bad_entry_cases(Path("x"), b"a\nb\nc\nd\ne\n")))
def test_bad_entries_are_discarded_and_rebuilt(tmp_path, kind) -> None:
    cache = _cache(tmp_path)
    data = _payload("key")
    cache.store("key", data)
    path = _entry(tmp_path)
    good = path.read_bytes()
    _bad_entry_cases(path, good)[kind]()
    start = time.perf_counter()
    assert cache.load("key") is None
    assert time.perf_counter() - start < 1.0  # nothing big is read
    assert not path.exists()
    assert cache.keys() == []
    cache.store("key", data)
    assert cache.load("key") == data
    assert cache.problem == ""


def test_an_entry_of_another_key_is_discarded(tmp_path) -> None:
    # A file renamed (or colliding) into another key's place: the full key is checked.
    cache = _cache(tmp_path)
    cache.store("first", _payload("first"))
    first = _entry(tmp_path)
    cache.store("second", _payload("second"))
    second = next(p for p in tmp_path.iterdir() if p != first)
    os.replace(first, second)
    assert cache.load("second") is None
    assert not second.exists()


def test_links_fifos_and_directories_in_place_of_an_entry(tmp_path) -> None:
    cache = _cache(tmp_path / "kernels")
    data = _payload("key")
    cache.store("key", data)
    path = _entry(tmp_path / "kernels")
    elsewhere = tmp_path / "elsewhere.jfk"
    path.rename(elsewhere)  # a valid entry, but reached through a link: not loaded
    path.symlink_to(elsewhere)
    assert cache.load("key") is None
    assert not path.is_symlink() and elsewhere.exists()  # the link goes, its target stays
    os.mkfifo(path)  # a FIFO must not block the reader
    start = time.perf_counter()
    assert cache.load("key") is None
    assert time.perf_counter() - start < 1.0 and not path.exists()
    path.mkdir()  # an empty directory is removed
    assert cache.load("key") is None and not path.exists()
    cache.store("key", data)
    assert cache.load("key") == data


def test_a_directory_that_cannot_be_removed_turns_the_cache_off(tmp_path) -> None:
    cache = _cache(tmp_path)
    cache.store("key", b"x")
    path = _entry(tmp_path)
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("keeps the directory")
    assert cache.load("key") is None
    cache.store("key", b"x")  # cannot rename over a directory: memory only from now on
    assert "cannot write" in cache.problem
    cache.store("other", b"y")
    assert cache.load("other") is None


@pytest.mark.skipif(not ROOT, reason="needs root to make a file owned by another user")
def test_an_entry_owned_by_another_user_is_discarded(tmp_path) -> None:
    cache = _cache(tmp_path)
    cache.store("key", _payload("key"))
    path = _entry(tmp_path)
    os.chown(path, 65534, 65534)
    assert cache.load("key") is None
    assert not path.exists()


# ----- unsafe or unusable directories -----------------------------------------------------------

def _assert_off(cache: object, directory: Path, problem: str) -> None:
    cache.store("key", b"data")
    assert cache.load("key") is None  # memory only: nothing is kept or read
    assert problem in cache.problem, cache.problem
    if directory.is_dir():
        assert not any(directory.iterdir()), "something was written"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702, 0o1777])
def test_a_directory_others_may_write_is_refused(tmp_path, mode) -> None:
    directory = tmp_path / "kernels"
    directory.mkdir()
    directory.chmod(mode)
    _assert_off(_cache(directory), directory, "writable by other users")


def test_a_directory_of_another_user_is_refused(tmp_path) -> None:
    if ROOT:
        directory = tmp_path / "kernels"
        directory.mkdir(mode=0o700)
        os.chown(directory, 65534, 65534)
    else:
        directory = Path("/")  # root's; never written to, since it is refused first
    _assert_off(_cache(directory), directory, "belongs to another user")


def test_a_file_in_the_way_is_refused(tmp_path) -> None:
    (tmp_path / "file").write_text("not a directory")
    _assert_off(_cache(tmp_path / "file" / "kernels"), tmp_path / "missing", "cannot create")
    _assert_off(_cache(tmp_path / "file"), tmp_path / "missing", "not a directory")


@pytest.mark.skipif(ROOT, reason="root may write to any directory")
def test_an_unwritable_directory_is_refused(tmp_path) -> None:
    directory = tmp_path / "kernels"
    directory.mkdir(mode=0o500)
    _assert_off(_cache(directory), directory, "cannot write")


def test_a_directory_removed_while_in_use(tmp_path) -> None:
    directory = tmp_path / "kernels"
    cache = _cache(directory)
    cache.store("key", b"data")
    for entry in directory.iterdir():
        entry.unlink()
    directory.rmdir()
    cache.store("other", b"more")  # the write fails: memory only, with the reason
    assert "cannot write" in cache.problem
    assert cache.load("key") is None


def test_empty_directory_means_memory_only(tmp_path) -> None:
    cache = _cache("")
    cache.store("key", b"data")
    assert cache.load("key") is None
    assert cache.problem == ""  # off on purpose: nothing to warn about


def test_the_warning_comes_once(monkeypatch) -> None:
    monkeypatch.setattr(compiled, "_warned_cache_problem", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled._warn_once_if_disk_cache_off("")
        for _ in range(3):
            compiled._warn_once_if_disk_cache_off("/x is writable by other users")
    assert [str(w.message) for w in caught] == [
        "jaxfuse keeps GPU kernels in memory only: /x is writable by other users"]
    assert all(w.category is RuntimeWarning for w in caught)


def test_import_configures_but_creates_nothing(tmp_path) -> None:
    code = ("import json, jaxfuse; from jaxfuse._extension import extension; "
            "print(json.dumps(extension().gpu_cache(keys=False)))")
    for value, expected in [(str(tmp_path / "c"), str(tmp_path / "c" / "kernels")), ("", "")]:
        env = {**os.environ, "JAXFUSE_CACHE_DIR": value}
        done = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        info = json.loads(done.stdout.strip().splitlines()[-1])
        assert info == {"directory": expected, "problem": "", "keys": []}
    assert not (tmp_path / "c").exists()


def _other_users_directory(tmp_path: Path) -> Path:
    if not ROOT:
        return Path("/")  # root's
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    return directory


def _chmod(directory: Path, mode: int) -> Path:
    directory.mkdir()
    directory.chmod(mode)
    return directory


def _file(path: Path) -> Path:
    path.write_text("not a directory")
    return path


@pytest.mark.parametrize("setup,problem", [
    (lambda tmp: _chmod(tmp / "kernels", 0o777), "is writable by other users"),
    (lambda tmp: _chmod(tmp / "kernels", 0o720), "is writable by other users"),
    (_other_users_directory, "belongs to another user"),
    (lambda tmp: _file(tmp / "file") / "kernels", "cannot create"),
    (lambda tmp: _file(tmp / "file"), "is not a directory"),
    (lambda tmp: tmp / "new" / "kernels", ""),  # created on first use
], ids=["world-writable", "group-writable", "another-user", "file-above", "file", "missing"])
def test_the_problem_is_known_before_first_use(tmp_path, setup, problem) -> None:
    # `python -m jaxfuse info` reports it without compiling anything; nothing is created.
    directory = setup(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    cache = _cache(directory)
    assert (problem in cache.problem) if problem else cache.problem == "", cache.problem
    assert sorted(tmp_path.rglob("*")) == before


def test_keys_are_not_read_from_a_directory_that_is_off(tmp_path) -> None:
    directory = tmp_path / "kernels"
    _cache(directory).store("plan-1", _payload("plan-1"))
    assert _cache(directory).keys() == ["plan-1"]
    directory.chmod(0o777)  # now anyone could have written the entries
    cache = _cache(directory)
    assert cache.keys() == []
    assert "writable by other users" in cache.problem


def _run(code: str, env: dict[str, str | None]) -> str:
    """Runs `code` in a child with os.environ changed by `env` (None removes a variable)."""
    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    done = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


_INFO = "import sys\nfrom jaxfuse.__main__ import main\nsys.exit(main(['info']))"


def test_info_says_why_an_unsafe_cache_directory_is_off(tmp_path) -> None:
    directory = tmp_path / "kernels"
    _cache(directory).store("secret-plan-key", b"data")
    directory.chmod(0o777)
    out = _run(_INFO, {"JAXFUSE_CACHE_DIR": str(tmp_path)})
    assert f"kernel cache: {directory}\n" in out
    assert f"  not used: {directory} is writable by other users" in out
    assert "0 compiled kernel(s)" in out and "secret-plan-key" not in out


def test_info_counts_measured_records_without_listing_them(tmp_path) -> None:
    """compile_ahead's records (one a signature measured on a GPU) are no kernels: the report
    counts them apart and lists none (it printed each as a kernel of unknown plan)."""
    cache = _cache(tmp_path / "kernels")
    cache.store("jaxfuse-measured-v1|cuda|NVIDIA H100 80GB HBM3|jax 0.11.2|jaxlib 0.11.2|"
                "jaxfuse 0.1.0 kernels 16f1|xla_flags c016|jaxfuse1;dtype=f32", b"1")
    out = _run(_INFO, {"JAXFUSE_CACHE_DIR": str(tmp_path)})
    assert "  0 compiled kernel(s), 0 solver decision(s), 1 signature(s) marked measured\n" in out
    assert "H100" not in out and "in=?" not in out


def test_info_tells_decisions_from_kernels_and_names_the_compilers_tried() -> None:
    from jaxfuse import __main__ as cli

    signature = Case(ops="CBNA", layout="NHWC", filter_layout="HWIO", n=1, c=16, k=64, h=7,
                     w=7, r=1, s=1, padding="VALID").build()[0].signature.encode()
    decision = ("jaxfuse-solver-v4|cpu|cpu 2 cpus, 2 threads|jax 0.10.2|jaxlib 0.10.2|jaxfuse "
                f"0.1.0 kernels 16f1|xla_flags c016|cpu|{signature}")
    line = cli._describe_key(decision)
    assert cli._is_decision(decision) and "?" not in line
    assert line.split()[:2] == ["cpu", "cpu"] and "CBNA" in line and "1x1/1 ->64" in line

    class NoCompiler:
        def gpu_compiler(self, platform: str) -> dict:
            raise RuntimeError("jaxfuse: cannot load the runtime compiler (NVRTC); tried:\n"
                               "  libnvrtc.so.13: cannot open shared object file\n"
                               "  libnvrtc.so: cannot open shared object file\nInstall it")

    assert cli._compilers(NoCompiler())[0] == "CUDA: no NVRTC (tried libnvrtc.so.13, libnvrtc.so)"


# A process whose user has no home directory: HOME unset and no password-file entry.
_NO_HOME = "import pwd\ndef _no_entry(uid): raise KeyError(uid)\npwd.getpwuid = _no_entry\n"


@pytest.mark.parametrize("env,prelude,origin", [
    ({"JAXFUSE_CACHE_DIR": "~jaxfuse_no_such_user_q7/cache"}, "",
     "JAXFUSE_CACHE_DIR='~jaxfuse_no_such_user_q7/cache'"),
    ({"HOME": None, "XDG_CACHE_HOME": None, "JAXFUSE_CACHE_DIR": None}, _NO_HOME,
     "the default, ~/.cache/jaxfuse"),
], ids=["unknown-user", "no-home"])
def test_an_unresolvable_cache_directory_turns_the_disk_cache_off(env, prelude, origin) -> None:
    problem = f"the kernel cache directory ({origin}) cannot be resolved: Could not determine " \
              "home directory."
    code = (prelude + "import json, jax.numpy as jnp, jaxfuse as jf\n"
            "from jaxfuse._extension import extension\n"
            "y = jf.bias_activation(jnp.ones((1, 2, 3, 3)), -jnp.ones(2))\n"
            "print(float(y.max()), json.dumps(extension().gpu_cache(keys=False)))")
    result, cache = _run(code, env).strip().splitlines()[-1].split(" ", 1)
    assert float(result) == 0.0  # import and CPU plans work
    assert json.loads(cache) == {"directory": "", "problem": problem, "keys": []}
    out = _run(prelude + _INFO, env)
    assert f"kernel cache: (disk cache off)\n  not used: {problem}\n" in out


def test_cache_dir_names_where_an_unresolvable_path_came_from(monkeypatch) -> None:
    monkeypatch.setenv("JAXFUSE_CACHE_DIR", "~jaxfuse_no_such_user_q7")
    with pytest.raises(RuntimeError, match="JAXFUSE_CACHE_DIR='~jaxfuse_no_such_user_q7'"):
        runtime.cache_dir()
    monkeypatch.delenv("JAXFUSE_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home(cls: type) -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", classmethod(no_home))
    with pytest.raises(RuntimeError, match=r"the default, ~/\.cache/jaxfuse"):
        runtime.kernel_cache_dir()
    monkeypatch.setenv("JAXFUSE_CACHE_DIR", "")
    assert runtime.cache_dir() is None


# ----- several processes on one cache -----------------------------------------------------------

# Loads only the extension (not jax): a child starts in well under a second.
_WORKER = textwrap.dedent("""
    import importlib.util, os, random, sys, time
    spec = importlib.util.spec_from_file_location("_jaxfuse_ext", sys.argv[1])
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    directory, role, seed, rounds = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    cache = ext._DiskCache()
    cache.configure(directory)
    rng = random.Random(seed)

    def payload(key, size):
        s = sum(key.encode())
        return bytes((s * 131 + i * 7) % 256 for i in range(size))

    keys = [(f"kernel-{i}", 1000 + 20011 * i) for i in range(6)]
    hits = 0
    for _ in range(rounds):
        key, size = rng.choice(keys)
        if role == "vandal":  # non-atomic garbage and truncations, as a crash would leave
            names = [n for n in os.listdir(directory) if n.endswith(".jfk")]
            if names:
                path = os.path.join(directory, rng.choice(names))
                try:
                    data = open(path, "rb").read()
                    with open(path, "wb") as f:
                        f.write(data[: rng.randrange(len(data) + 1)])
                except OSError:
                    pass
            continue
        if rng.random() < 0.5:
            cache.store(key, payload(key, size))
        got = cache.load(key)
        if got is not None:
            assert got == payload(key, size), f"wrong bytes for {key}"
            hits += 1
    assert cache.problem == "", cache.problem
    print(hits)
""")


def test_processes_share_one_cache(tmp_path) -> None:
    directory = tmp_path / "kernels"
    _cache(directory).load("create")  # creates the directory
    library = extension().__file__
    roles = ["worker"] * 4 + ["vandal"]
    children = [subprocess.Popen([sys.executable, "-P", "-c", _WORKER, library, str(directory),
                                  role, str(seed), "150"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
                for seed, role in enumerate(roles)]
    outputs = [child.communicate(timeout=300) for child in children]
    for child, (_, err) in zip(children, outputs):
        assert child.returncode == 0, err
    assert sum(int(out) for (out, _), r in zip(outputs, roles) if r == "worker") > 100
    # Whatever the vandal left is either verified or discarded; nothing half-written remains
    # under an entry's name, and no temporary file is left behind.
    cache = _cache(directory)
    for i in range(6):
        key = f"kernel-{i}"
        got = cache.load(key)
        assert got is None or got == _payload(key, 1000 + 20011 * i)
    assert not [p for p in directory.iterdir() if ".tmp" in p.name]


# ----- on a GPU: the same through real kernel compilations --------------------------------------

_GPU_CHILD = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("always")
    import jax
    sys.path.insert(0, {tests!r})
    from cases import Case, run_case
    from jaxfuse._extension import extension
    device = jax.devices("gpu")[0]
    errors = [run_case(Case(ops="CBA", c=16, k=24, h=10, w=10, layout="NHWC",
                            filter_layout="HWIO", dtype="float16"), device),
              run_case(Case(ops="NA", c=8, h=6, w=6, dtype="bfloat16"), device)]
    print(json.dumps({{"stats": extension().gpu_stats(), "errors": errors}}))
""")


def _gpu_children(cache_dir: Path, count: int) -> list[tuple[dict, str]]:
    # Children share the GPU with this process and each other: no up-front memory grab.
    env = {**os.environ, "JAXFUSE_CACHE_DIR": str(cache_dir),
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    code = _GPU_CHILD.format(tests=os.path.dirname(__file__))
    children = [subprocess.Popen([sys.executable, "-P", "-c", code], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(count)]
    results = []
    for child in children:
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-4000:]
        results.append((json.loads(out.strip().splitlines()[-1]), err))
    return results


@pytest.mark.gpu
def test_gpu_processes_share_one_cache(tmp_path) -> None:
    for result, _ in _gpu_children(tmp_path, 3):  # at once, on an empty cache
        stats = result["stats"]
        assert stats["compilations"] + stats["disk_hits"] == 2  # at most one build per plan
    ((later, _),) = _gpu_children(tmp_path, 1)
    assert later["stats"]["compilations"] == 0 and later["stats"]["disk_hits"] == 2


@pytest.mark.gpu
def test_gpu_unsafe_cache_dir_warns_once(tmp_path) -> None:
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels").chmod(0o777)
    ((result, stderr),) = _gpu_children(tmp_path, 1)
    assert stderr.count("jaxfuse keeps GPU kernels in memory only") == 1, stderr[-4000:]
    assert "writable by other users" in stderr
    assert result["stats"]["compilations"] == 2 and result["stats"]["disk_hits"] == 0
    assert not any((tmp_path / "kernels").iterdir())


def test_info_says_how_kernels_enter_command_buffers(monkeypatch) -> None:
    from jaxfuse import __main__ as cli

    class Headers:
        def register_cuda_record(self, name: str) -> tuple[str, str]:
            return "done", ""

    assert "no record stage" in cli._command_buffers(object())
    monkeypatch.setenv("JAXFUSE_PDL", "0")
    assert cli._command_buffers(Headers()).endswith("programmatic dependent launch off "
                                                    "(JAXFUSE_PDL=0)")
    monkeypatch.delenv("JAXFUSE_PDL")
    assert cli._command_buffers(Headers()).endswith("on sm_90 and later")
    monkeypatch.setenv("JAXFUSE_FFI_RECORD", "0")
    assert "JAXFUSE_FFI_RECORD=0" in cli._command_buffers(Headers())
