import json

import pytest

from domainfm import cli, hub

COMMANDS = ["list", "info", "download", "pretrain", "finetune", "evaluate", "predict"]


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(([command] if command else []) + ["--help"])
    assert exc.value.code == 0
    assert "usage: domainfm" in capsys.readouterr().out


def test_list_and_info(tiny_zoo, capsys):
    assert cli.main(["list", "dfmtest-*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["dfmtest-small", "dfmtest-tiny"]
    assert cli.main(["info", "dfmtest-small"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["name"] == "dfmtest-small" and info["num_params"] == sum(
        p.numel() for p in tiny_zoo.Net(hidden=16).parameters())


def test_download_verifies_and_caches(tiny_zoo, http_server, tmp_path, capsys):
    import hashlib
    import io

    import torch

    buf = io.BytesIO()
    torch.save(tiny_zoo.state_dict(), buf)
    body = buf.getvalue()
    url = http_server.serve("/w/tiny.pth", body)
    tiny_zoo.register("dfmtest-dl", weights=[hub_source(url, hashlib.sha256(body).hexdigest())])
    assert cli.main(["download", "dfmtest-dl"]) == 0
    cached = hub.cache_path_for(url)
    assert cached.read_bytes() == body
    assert str(cached) in capsys.readouterr().out


def hub_source(url, digest):
    from domainfm import WeightSource

    return WeightSource(url, sha256=digest)


def test_unknown_family_is_named():
    with pytest.raises(SystemExit, match="no finetune entry for family 'nosuchfamily'"):
        cli.main(["finetune", "nosuchfamily"])


def test_evaluate_rejects_non_run_folder(tmp_path, capsys):
    assert cli.main(["evaluate", str(tmp_path)]) == 2
    assert "not a domainfm run folder" in capsys.readouterr().err


def test_overrides_may_follow_options(monkeypatch, tmp_path):
    seen = {}

    def fake_run(kind, args):
        seen.update(kind=kind, overrides=args.overrides, runs_dir=args.runs_dir, name=args.name)
        return 0

    monkeypatch.setattr(cli, "_run_family", fake_run)
    assert cli.main(["finetune", "fam", "a.b=1", "--runs-dir", str(tmp_path), "c=2", "--name", "r1", "d.e=[1, 2]"]) == 0
    assert seen == {"kind": "finetune", "overrides": ["a.b=1", "c=2", "d.e=[1, 2]"], "runs_dir": str(tmp_path), "name": "r1"}
    with pytest.raises(SystemExit):
        cli.main(["finetune", "fam", "--runs-dir", str(tmp_path), "--bogus"])
