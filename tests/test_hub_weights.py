"""Named weights must load (a file that fails stops the CLI even with fallback random; what is not a
checkpoint is named as such) and the cache verifies what it serves (domainfm.hub)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from domainfm import cli


# --------------------------------------------------------------------------- named weights must load


class _Exec:
    def __reduce__(self):
        import builtins

        return (builtins.exec, ("open('/dev/null')",))


def _tiny_eeg_args(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_cbramod_tests", Path(__file__).parent / "finetune" / "test_cbramod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._common(tmp_path)


@pytest.mark.parametrize("kind", ["unsafe", "corrupt", "other_family", "text"])
def test_named_weights_file_that_fails_stops_the_cli_even_with_fallback_random(kind, tmp_path, capsys):
    from domainfm import create_model

    path = tmp_path / f"{kind}.pth"
    if kind == "unsafe":
        torch.save({"model": _Exec()}, path)
    elif kind == "corrupt":
        buffer = __import__("io").BytesIO()
        torch.save(create_model("cbramod-test", n_outputs=None).state_dict(), buffer)
        path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    elif kind == "other_family":
        torch.save({"body.0.weight": torch.zeros(4, 3), "head.weight": torch.zeros(2, 4)}, path)
    else:
        path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    args = ["finetune", "cbramod", *_tiny_eeg_args(tmp_path), f"model.pretrained={path}", "model.fallback=random",
            "arms=[pretrained]", "train.max_steps=2", "--runs-dir", str(tmp_path / "runs"), "--name", kind]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "RANDOM" not in err and "Traceback" not in err
    first = next(line for line in err.splitlines() if line.startswith("domainfm finetune: error:"))
    assert str(path) in first
    assert not (tmp_path / "runs" / "cbramod" / kind / "report.json").exists()


def test_non_checkpoint_files_are_named_as_such_and_code_only_where_met(tmp_path):
    from domainfm import hub

    cases = {"text.pth": b"hello world\nthis is text\n", "passwd.pth": b"root:x:0:0:root:/root:/bin/bash\n",
             "random.pth": bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).to(torch.uint8).tolist()),
             "random.safetensors": b"\x00\xff" * 100, "empty.bin": b""}
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(hub.HubError) as info:
            hub.load_checkpoint(path)
        message = str(info.value)
        assert not isinstance(info.value, hub.UnsafeCheckpointError), name
        assert message.startswith(f"{path}: not a checkpoint") and \
            "not a safetensors file, not a torch zip archive, not a pickle" in message, message
        assert "execute code" not in message
    evil = tmp_path / "evil.pth"
    torch.save({"w": _Exec()}, evil)
    with pytest.raises(hub.UnsafeCheckpointError, match=r"would execute code.*exec"):
        hub.load_checkpoint(evil)
    # a safetensors file under another name is read as what it is
    from safetensors.torch import save_file

    save_file({"w": torch.arange(3.0)}, str(tmp_path / "st.pth"))
    assert torch.equal(hub.load_checkpoint(tmp_path / "st.pth")["w"], torch.arange(3.0))


# --------------------------------------------------------------------------- the cache verifies what it serves


def test_unpinned_download_is_recorded_and_a_tampered_cache_file_refused(http_server, domainfm_home):
    import hashlib
    import warnings

    from domainfm import hub

    body = b"weights" * 1000
    url = http_server.serve("/free/good.pth", body)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = hub.fetch(url, progress=False)
    digest = hashlib.sha256(body).hexdigest()
    record = json.loads((domainfm_home / hub.LOCK_FILE_NAME).read_text())
    assert record["files"][path.relative_to(hub.weights_dir()).as_posix()]["sha256"] == digest
    assert hub.fetch(url, progress=False) == path  # verified and served from the cache
    assert http_server.hit_count("/free/good.pth") == 1

    path.write_bytes(b"tampered" + body[8:])
    tampered = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(hub.ChecksumError) as info:
        hub.fetch(url, progress=False)
    assert digest in str(info.value) and tampered in str(info.value) and str(path) in str(info.value)
    assert http_server.hit_count("/free/good.pth") == 1


def test_query_strings_are_cached_apart_and_credentials_stay_out_of_paths(http_server, domainfm_home):
    import warnings

    from domainfm import hub

    url = http_server.serve("/q/good.pth", b"version one")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = hub.fetch(url + "?version=1", progress=False)
        http_server.serve("/q/good.pth", b"version two")
        second = hub.fetch(url + "?version=2", progress=False)
    assert first != second and first.name == second.name == "good.pth"
    assert first.read_bytes() == b"version one" and second.read_bytes() == b"version two"
    assert http_server.hit_count("/q/good.pth") == 2
    assert hub.cache_path_for(url) not in {first, second}
    secret = hub.cache_path_for("https://alice:s3cret@example.org/w/model.pth?token=abc123")
    assert "s3cret" not in str(secret) and "abc123" not in str(secret) and "alice" not in str(secret)
    assert secret != hub.cache_path_for("https://example.org/w/model.pth?token=other")
    assert secret.is_relative_to(hub.weights_dir() / "url" / "example.org")
