"""speed.storage: a local path, a file:// URI, an fsspec memory:// URI and s3:// on a real S3 API behave alike."""

import pyarrow.fs as pafs
import pytest

from speed.storage import absolute, locate


def _where(kind, tmp_path, request):
    if kind == "memory":
        return request.getfixturevalue("memory_store")
    if kind == "s3":  # the session's S3 server (tests/s3_helpers.py), reached through AWS_ENDPOINT_URL
        return f"{request.getfixturevalue('s3_bucket')}/store"
    return {"path": str(tmp_path / "store"), "file": f"file://{tmp_path}/store"}[kind]


@pytest.mark.parametrize("kind", ["path", "file", "memory", "s3"])
def test_every_operation_works_on_local_paths_and_uris(kind, tmp_path, request):
    where = _where(kind, tmp_path, request)
    root = locate(where)
    assert root.local == (kind in ("path", "file")) and root.uri == where
    assert not root.exists() and root.entries() == []
    (root / "sub").makedirs()
    (root / "sub" / "a.txt").write_text("hello")
    (root / "b.bin").write_bytes(b"\x00\x01")
    assert (root / "sub" / "a.txt").read_text() == "hello" and (root / "b.bin").read_bytes() == b"\x00\x01"
    assert (root / "sub").is_dir() and not (root / "sub").is_file() and (root / "b.bin").is_file()
    assert [(i.base_name, i.type) for i in root.entries()] == [
        ("b.bin", pafs.FileType.File),
        ("sub", pafs.FileType.Directory),
    ]
    assert (root / "sub" / "a.txt").uri == f"{where}/sub/a.txt"

    folder = tmp_path / "local"
    folder.mkdir()
    (folder / "x.txt").write_text("x")
    (root / "up").upload(folder)
    back = tmp_path / "back"
    back.mkdir()
    (root / "up").download(back)
    assert (back / "x.txt").read_text() == "x"

    (root / "sub").delete()
    (root / "b.bin").delete()
    (root / "missing").delete()  # nothing there: nothing to do
    assert [i.base_name for i in root.entries()] == ["up"]


@pytest.mark.parametrize("kind", ["path", "memory", "s3"])
def test_atomic_writes_appear_whole_or_not_at_all(kind, tmp_path, request):
    root = locate(_where(kind, tmp_path, request))
    root.makedirs()
    target = root / "data.txt"
    with target.atomic() as partial:
        root.fs.open_output_stream(partial).close()
        assert not target.exists()
        assert [i.base_name for i in root.entries()][0].startswith(".data.txt.")  # a dot name readers skip
        with root.fs.open_output_stream(partial) as f:
            f.write(b"whole")
    assert target.read_text() == "whole"
    with pytest.raises(RuntimeError, match="cut short"):
        with (root / "other.txt").atomic() as partial:
            with root.fs.open_output_stream(partial) as f:
                f.write(b"half")
            raise RuntimeError("cut short")
    assert [i.base_name for i in root.entries()] == ["data.txt"]  # neither the file nor its partial


def test_local_paths_become_absolute_and_uris_stay_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute("runs") == str(tmp_path / "runs") == locate("runs").path
    assert absolute("s3://bucket/runs") == "s3://bucket/runs"
    assert locate(f"file://{tmp_path}/runs").path == str(tmp_path / "runs")
