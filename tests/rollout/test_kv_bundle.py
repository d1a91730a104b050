"""A KV bundle reads back as written, and bytes that are not a whole bundle are refused with what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.rollout.kv_bundle import KvBundleError, KvManifest, pack_bundle, unpack_bundle

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.0123456789", min_size=1, max_size=40).filter(
    lambda n: not n.startswith("."))


def bundle_of(files: dict[str, bytes]) -> bytes:
    manifest = KvManifest(fingerprint="f" * 64, folder="abc", prompt_tokens=33,
                          files=tuple((n, len(d)) for n, d in files.items()))
    return pack_bundle(manifest, files)


@given(st.dictionaries(names, st.binary(max_size=2000), min_size=1, max_size=6))
def test_a_bundle_unpacks_to_the_files_packed(files: dict[str, bytes]) -> None:
    manifest, got = unpack_bundle(bundle_of(files))
    assert got == files and manifest.prompt_tokens == 33 and manifest.fingerprint == "f" * 64


def test_a_truncated_bundle_is_refused_at_any_cut() -> None:
    data = bundle_of({"model.layers.0.self_attn.attn.safetensors": b"k" * 300, "layer1.safetensors": b"v" * 300})
    for cut in (0, 5, 9, 16, 40, len(data) // 2, len(data) - 1):
        with pytest.raises(KvBundleError):
            unpack_bundle(data[:cut])
    with pytest.raises(KvBundleError, match="truncated"):
        unpack_bundle(data + b"extra")


def test_bytes_that_are_not_a_bundle_are_named_so() -> None:
    with pytest.raises(KvBundleError, match="not a KV bundle"):
        unpack_bundle(b"PK\x03\x04 a zip file")


def test_a_file_name_that_leaves_the_folder_is_refused() -> None:
    with pytest.raises(KvBundleError, match="outside"):
        unpack_bundle(bundle_of({"../escape": b"x"}))


def test_files_that_disagree_with_the_manifest_are_not_packed() -> None:
    manifest = KvManifest(fingerprint="f", folder="abc", prompt_tokens=33, files=(("a", 3),))
    with pytest.raises(KvBundleError, match="manifest"):
        pack_bundle(manifest, {"a": b"four"})
    with pytest.raises(KvBundleError, match="manifest"):
        pack_bundle(manifest, {"b": b"abc"})


def test_kv_in_transit_goes_to_shared_memory_when_the_node_has_room_else_to_the_state_folder(tmp_path) -> None:
    from services.rollout.engine_environment import default_kv_storage

    shm, state = tmp_path / "shm", tmp_path / "state"
    shm.mkdir()
    # This test's folder stands for /dev/shm (a GiB free on this disk): the run and worker name the folder.
    assert default_kv_storage(state, "run/1", "vm-cell0", shm=shm) == shm / "gyre-kv" / "run-1" / "vm-cell0"
    assert default_kv_storage(state, "run-1", "vm-cell0", shm=tmp_path / "none") == state / "kv" / "vm-cell0"
    (tmp_path / "file").write_text("not a folder")
    assert default_kv_storage(state, "run-1", "vm-cell0", shm=tmp_path / "file") == state / "kv" / "vm-cell0"


def test_the_engines_ipc_folder_is_short_enough_for_a_socket_path_wherever_the_work_folder_is(tmp_path) -> None:
    from services.rollout.engine_environment import IPC_FOLDER_MAX_CHARS, ipc_folder

    short = Path("/tmp") / f"g-{tmp_path.name[:8]}"
    assert ipc_folder(short) == short and short.is_dir()
    short.rmdir()
    deep = tmp_path / ("x" * 80) / "tmp"
    chosen = ipc_folder(deep)
    # A worker's deep folder would leave no room under the 107-byte limit once vLLM names a socket in it.
    assert chosen != deep and chosen.is_dir() and len(str(chosen)) <= IPC_FOLDER_MAX_CHARS
    assert len(f"ipc://{chosen}/{'0' * 36}") <= 107
    chosen.rmdir()


def test_an_engines_inductor_headers_go_to_the_shared_cache_when_one_is_named(tmp_path, monkeypatch) -> None:
    """torch keeps its precompiled headers under TMPDIR whatever TORCHINDUCTOR_CACHE_DIR says: with a shared cache
    named, the folder torch looks in under the run's scratch TMPDIR is a link to it, made once."""
    import getpass

    from services.rollout.engine_environment import share_inductor_headers

    scratch, shared = tmp_path / "scratch", tmp_path / "cache" / "torchinductor"
    scratch.mkdir()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    share_inductor_headers(scratch)
    assert list(scratch.iterdir()) == []  # no shared cache named: torch's own folder under TMPDIR, as before
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    share_inductor_headers(scratch)
    share_inductor_headers(scratch)  # a second engine of the run finds the link made
    link = scratch / f"torchinductor_{getpass.getuser()}"
    assert link.is_symlink() and link.resolve() == shared.resolve() and shared.is_dir()
