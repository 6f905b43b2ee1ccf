"""atomic_write, the one way the suite rewrites a file: the reader sees the old
file or the new one, an error leaves the old one and no temporary file, and
the permissions and links of what it replaces are kept."""

import os
import stat
import threading

import pytest

from hpcjobs._files import atomic_write


def _names(d):
    return sorted(p.name for p in d.iterdir())


def test_the_new_content_replaces_the_old_and_nothing_else_is_left(tmp_path):
    target = tmp_path / "t.json"
    target.write_text("old\n")
    with atomic_write(target) as f:
        f.write("new\n")
        assert target.read_text() == "old\n"  # until the block ends
    assert target.read_text() == "new\n"
    assert _names(tmp_path) == ["t.json"]
    with atomic_write(tmp_path / "b.pt", "wb", durable=True) as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "b.pt").read_bytes() == b"\x00\x01"


def test_an_error_in_the_block_leaves_the_old_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "t.json"
    target.write_text("old\n")
    with pytest.raises(KeyError):
        with atomic_write(target) as f:
            f.write("half")
            raise KeyError("a record that cannot be written")
    assert target.read_text() == "old\n"
    assert _names(tmp_path) == ["t.json"]
    with pytest.raises(KeyError):
        with atomic_write(tmp_path / "new.json") as f:
            raise KeyError("nothing yet")
    assert _names(tmp_path) == ["t.json"]


def test_the_benchmark_report_writers_leave_nothing_behind_on_an_error(tmp_path):
    """write_json and write_csv wrote ``<path>.tmp`` and left it there when a
    record failed to convert."""
    from hpcjobs.bench.report import write_csv, write_json

    class Broken:
        def to_dict(self):
            raise ValueError("cannot convert")

    for write, args in ((write_json, ({},)), (write_csv, ())):
        target = tmp_path / f"r.{write.__name__}"
        target.write_text("the last run's\n")
        with pytest.raises(ValueError, match="cannot convert"):
            write(str(target), [Broken()], *args)
        assert target.read_text() == "the last run's\n"
    assert _names(tmp_path) == ["r.write_csv", "r.write_json"]


def test_permissions_are_kept_and_a_new_file_gets_the_umasks(tmp_path):
    kept = tmp_path / "kept"
    kept.write_text("x")
    kept.chmod(0o640)
    with atomic_write(kept) as f:
        f.write("y")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640
    umask = os.umask(0o027)
    try:
        with atomic_write(tmp_path / "fresh") as f:
            f.write("z")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o640  # 0o666 & ~0o027


def test_a_link_is_written_through_not_replaced(tmp_path):
    (tmp_path / "real").write_text("old")
    (tmp_path / "link").symlink_to("real")
    with atomic_write(tmp_path / "link") as f:
        f.write("new")
    assert (tmp_path / "link").is_symlink()
    assert (tmp_path / "real").read_text() == "new"


def test_two_threads_writing_one_file_each_leave_a_whole_file(tmp_path):
    """Each writer has a temporary file of its own; one shared name let one
    rename the other's half-written file into place."""
    target = tmp_path / "t"
    texts = ["a" * 200_000, "b" * 300_000]
    errors = []

    def write(text):
        try:
            for _ in range(20):
                with atomic_write(target) as f:
                    for i in range(0, len(text), 1000):
                        f.write(text[i:i + 1000])
        except Exception as e:  # pragma: no cover - the assertion below reports it
            errors.append(e)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_text() in texts
    assert _names(tmp_path) == ["t"]


def test_a_mode_other_than_writing_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb', not 'a'"):
        with atomic_write(tmp_path / "t", "a"):
            pass


def test_what_is_not_a_regular_file_is_written_in_place(tmp_path):
    """``--json /dev/stdout``: a temporary file renamed over it would replace
    the device (as root, /dev/null itself); a pipe stands in for it here."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    with atomic_write(fifo) as f:
        f.write("through the pipe")
    reader.join(timeout=30)
    assert got == ["through the pipe"]
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert _names(tmp_path) == ["fifo"]


def test_a_link_to_a_pipe_is_written_through_as_dev_stdout_is(tmp_path):
    """``/dev/stdout`` links to ``/proc/self/fd/1``, which resolves to no file
    (``pipe:[N]``): the check follows the links before it resolves them."""
    r, w = os.pipe()
    (tmp_path / "stdout").symlink_to(f"/proc/self/fd/{w}")
    try:
        with atomic_write(tmp_path / "stdout") as f:
            f.write("to the reader")
        os.close(w)
        w = None
        with os.fdopen(r) as reader:
            r = None
            assert reader.read() == "to the reader"
    finally:
        for fd in (r, w):
            if fd is not None:
                os.close(fd)
    assert _names(tmp_path) == ["stdout"]


def test_dev_stdout_redirected_to_a_file_is_written_in_place(tmp_path):
    """``--json /dev/stdout > out.json``: /dev/stdout resolves to out.json, a
    regular file; renamed over it, the file lost what was printed before and
    after (the command's table), which went to the old, unlinked file."""
    import subprocess
    import sys

    out = tmp_path / "out.json"
    code = ("from hpcjobs._files import atomic_write\n"
            "print('the table')\n"  # still in sys.stdout's buffer: flushed before the JSON goes through fd 1
            "with atomic_write('/dev/stdout') as f:\n    f.write('{\"rows\": []}\\n')\n"
            "print('# wrote it', flush=True)\n")
    with open(out, "w") as stdout:
        subprocess.run([sys.executable, "-c", code], stdout=stdout, check=True, timeout=60)
    assert out.read_text() == 'the table\n{"rows": []}\n# wrote it\n'
    assert _names(tmp_path) == ["out.json"]
