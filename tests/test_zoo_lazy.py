"""Lazy registration: looking a name up imports only the family that registers it.

Each check that needs a fresh interpreter (what a lookup imports) runs in a subprocess; the
eager registry (every family imported) is the reference for which factory a name must reach.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

import domainfm
from domainfm import zoo

#: modules only some families import (explora: timm; git: torch_geometric and transformers)
HEAVY = ("timm", "torch_geometric", "transformers")


def _families_script() -> str:
    return ("def families():\n"
            "    return sorted(k for k in sys.modules if k.startswith('domainfm.models.') and k.count('.') == 2)\n")


def _run(script: str) -> dict:
    code = "import json, sys\n" + _families_script() + textwrap.dedent(script)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _factory(card: zoo.ModelCard) -> list:
    builder = card.builder
    return [card.family, getattr(builder, "__module__", None), getattr(builder, "__qualname__", repr(builder)),
            repr(sorted(card.defaults.items()))]


def test_create_model_imports_only_its_family():
    out = _run("""
        import torch
        import domainfm
        from domainfm import zoo
        before = families()
        torch.manual_seed(0)
        model = domainfm.create_model("cbramod-test")
        after_create = families()
        heavy_after_create = [m for m in %r if m in sys.modules]
        info = zoo.model_info("cbramod-base")  # what `domainfm info` does
        dynamo_after_info = "torch._dynamo" in sys.modules
        checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
        n_params = sum(p.numel() for p in model.parameters())
        # a plugin's own name (no table entry) resolves from the registry without importing families
        zoo.register_model("dfmplugin-x", family="dfmplugin")(lambda: torch.nn.Linear(2, 2))
        zoo.get_card("dfmplugin-x")
        after_plugin = families()
        # an unknown name still imports everything before failing, so the message counts every model
        try:
            zoo.get_card("cbramod-huge")
            unknown = None
        except KeyError as exc:
            unknown = [type(exc).__name__, str(exc)]
        n_all = len(zoo.list_models())
        heavy_after_all = [m for m in %r if m in sys.modules]
        print(json.dumps(dict(before=before, after_create=after_create, heavy_after_create=heavy_after_create,
                              info_params=info["num_params"], dynamo_after_info=dynamo_after_info,
                              checksum=checksum, n_params=n_params, after_plugin=after_plugin, unknown=unknown,
                              n_all=n_all, all_families=families(), heavy_after_all=heavy_after_all)))
    """ % (HEAVY, HEAVY))
    assert out["before"] == []
    assert out["after_create"] == ["domainfm.models.cbramod"]
    assert out["heavy_after_create"] == []
    # model_info counts on the meta device without running the initialisers (whose meta
    # decompositions import torch._dynamo, seconds): same count as a full build
    assert out["dynamo_after_info"] is False
    assert out["info_params"] == sum(p.numel() for p in domainfm.create_model("cbramod-base").parameters())
    assert out["after_plugin"] == ["domainfm.models.cbramod"]
    # the test can fail: importing every family does bring the heavy modules in
    assert set(out["heavy_after_all"]) >= {"timm", "torch_geometric"}
    assert len(out["all_families"]) >= 7
    # the lazily built model is the eager registry's model: same parameters for the same seed
    torch.manual_seed(0)
    model = domainfm.create_model("cbramod-test")
    assert out["n_params"] == sum(p.numel() for p in model.parameters())
    assert abs(out["checksum"] - sum(float(p.detach().double().sum()) for p in model.parameters())) < 1e-9
    # unknown names: the same clear error as before, counting every registered model, with similar names
    kind, message = out["unknown"]
    assert kind == "UnknownModelError"
    assert message.startswith("Unknown model 'cbramod-huge'. `domainfm.list_models()` lists the "
                              f"{out['n_all']} registered models.")  # every family's, and the plugin's
    assert "Similar names: cbramod-base, cbramod-test." in message


def _family_names() -> list[str]:
    """Every name a family folder registers (not names tests or plugins register at run time)."""
    return [n for n in domainfm.list_models()
            if str(getattr(zoo.get_card(n).builder, "__module__", "")).startswith("domainfm.models.")]


def test_table_names_the_family_of_every_registered_model():
    """Static check: a new model (or family) without a FAMILY_OF_NAME entry fails here, by name."""
    names = _family_names()
    assert len(names) >= 40 and {zoo.get_card(n).family for n in names} >= {
        "cbramod", "wavetoken", "explora", "fim", "git", "stofm", "wearables"}
    missing = [n for n in names if zoo.family_module_of(n) is None]
    assert not missing, f"add patterns for these names to their family's manifest.json: {missing}"
    wrong = [(n, zoo.family_module_of(n), zoo.get_card(n).builder.__module__) for n in names
             if zoo.get_card(n).builder.__module__.split(".")[:3] != zoo.family_module_of(n).split(".")]
    assert not wrong, f"the manifests send these names to the wrong family: {wrong}"


def test_every_registered_name_resolves_lazily_to_the_eager_factory():
    """In a fresh interpreter, each registered name (sorted, one after the other) resolves through
    the table, importing no family but its own, to the factory the eager registry holds."""
    eager = {n: _factory(zoo.get_card(n)) for n in _family_names()}
    out = _run("""
        from domainfm import zoo
        names = %r
        seen = {}
        for name in names:
            before = set(families())
            card = zoo.get_card(name)
            builder = card.builder
            seen[name] = dict(new=sorted(set(families()) - before), now=families(),
                              factory=[card.family, getattr(builder, "__module__", None),
                                       getattr(builder, "__qualname__", repr(builder)),
                                       repr(sorted(card.defaults.items()))])
        print(json.dumps(seen))
    """ % sorted(eager))
    assert set(out) == set(eager)
    for name, got in out.items():
        own = zoo.family_module_of(name)
        assert set(got["new"]) <= {own}, f"{name}: imported {got['new']}, expected only {own}"
        assert own in got["now"], name
        assert got["factory"] == eager[name], name


def test_model_info_counts_every_model_like_a_plain_meta_build():
    """model_info skips the initialisers on the meta device: the count (and every parameter's
    and buffer's shape) is the one of a plain meta build, for every registered model."""
    for name in _family_names():
        with torch.device("meta"):
            plain = zoo.build_model(name)
        with torch.device("meta"), zoo._SkipInitOnMeta():
            skipped = zoo.build_model(name)
        assert {k: v.shape for k, v in skipped.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}, name
        assert domainfm.model_info(name)["num_params"] == sum(p.numel() for p in plain.parameters()), name


def test_every_manifest_is_its_familys_live_registry():
    """The manifests answer `domainfm list/info` without importing families: each must equal what
    its family registers (cards and parameter counts). Stale: run `python -m domainfm.zoo`."""
    live: dict[str, dict] = {}
    for name in _family_names():
        live.setdefault(zoo.get_card(name).family, {})[name] = json.loads(json.dumps(zoo._live_info(name)))
    manifests = zoo.manifests()
    assert sorted(manifests) == sorted(live)
    for family, manifest in manifests.items():
        assert manifest["models"] == live[family], f"{family}: manifest.json is stale; run python -m domainfm.zoo"
        assert manifest["domain"] and all(zoo.family_module_of(n) == f"domainfm.models.{family}" for n in live[family])


def test_list_info_and_help_import_no_family_and_answer_like_the_live_registry():
    heavy = ("timm", "torch_geometric", "scanpy", "anndata", "mne", "numba", "lightning", "lightning_fabric",
             "transformers")
    out = _run("""
        import contextlib, io
        from domainfm import cli
        answers = {}
        for argv in (["--help"], ["list"], ["list", "--pretrained"], ["info", "cbramod-base"],
                     ["info", "fim-imputation-small.synthetic-prior"]):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                try:
                    cli.main(argv)
                except SystemExit:
                    pass
            answers[" ".join(argv)] = buf.getvalue()
        print(json.dumps(dict(families=families(), heavy=[m for m in %r if m in sys.modules], answers=answers)))
    """ % (heavy,))
    assert out["families"] == [] and out["heavy"] == []
    # the same answers as with every family imported
    import contextlib
    import io

    from domainfm import cli

    zoo._ensure_families_imported()
    for argv, text in out["answers"].items():
        if argv == "--help":
            assert "predict" in text and "list" in text
            continue
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            cli.main(argv.split())
        if argv.startswith("info"):
            assert json.loads(text) == json.loads(buf.getvalue()), argv
        else:
            assert text == buf.getvalue(), argv
    assert len(out["answers"]["list"].splitlines()) == len(zoo.list_models())
