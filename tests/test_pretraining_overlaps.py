"""What each published checkpoint saw in pretraining, and which public benchmarks that data contains:
shown by ``domainfm info`` and written into every model card saved from a model that started there."""
from __future__ import annotations

import json

import domainfm
from domainfm import cli, hub, zoo
from domainfm.experiment.weights import InitInfo

#: the TUH corpora that are subsets of TUEG, the corpus CBraMod pretrains on (TUH's READMEs)
TUEG_SUBSETS_CBRAMOD_REPORTS = {"TUAB", "TUEV"}
#: Benchmark I of the Chronos paper: the 15 in-domain datasets whose training portions Chronos trained on
#: (chronos-forecasting scripts/evaluation/configs/in-domain.yaml, by its dataset ids)
CHRONOS_IN_DOMAIN_IDS = ["electricity_15min", "monash_electricity_hourly", "monash_electricity_weekly",
                         "monash_kdd_cup_2018", "m4_daily", "m4_hourly", "m4_monthly", "m4_weekly",
                         "monash_pedestrian_counts", "taxi_30min", "uber_tlc_hourly", "uber_tlc_daily",
                         "monash_rideshare", "monash_temperature_rain", "monash_london_smart_meters"]


def _section(text: str, title: str) -> list[str]:
    body = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in body.splitlines() if line]


def test_info_names_tuab_and_tuev_as_overlaps_of_the_official_cbramod_weights(capsys):
    assert cli.main(["info", "cbramod-base"]) == 0
    info = json.loads(capsys.readouterr().out)
    (official,) = info["weights"]
    assert official["url"] == "hf://weighting666/CBraMod/pretrained_weights.pth"
    assert official["pretraining_data"].startswith("TUEG (Temple University Hospital EEG Corpus)")
    assert TUEG_SUBSETS_CBRAMOD_REPORTS <= set(official["overlaps"])
    assert "not confirmed" in official["note"]  # what the exclusion status is, said rather than implied
    # the test-sized variant has no weights, so nothing to overlap
    assert cli.main(["info", "cbramod-test"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == []


def test_card_saved_from_cbramod_base_lists_tueg_and_its_overlaps(tmp_path):
    """cbramod-base's architecture at a tiny size (its card's source applies), fine-tuned from the
    official weights as the experiment layer records it (the arm's init), saved with save_pretrained."""
    from domainfm.models.cbramod.variants import OFFICIAL_SHA256, OFFICIAL_URL

    model = domainfm.create_model("cbramod-base", n_chans=4, n_times=400, n_layers=2, dim_feedforward=64,
                                  n_outputs=2)
    report = {"arms": {"pretrained": {"init": str(InitInfo("pretrained", source=OFFICIAL_URL, sha256=OFFICIAL_SHA256)),
                                      "test": {"balanced_accuracy": 0.5}},
                       "random": {"init": str(InitInfo("random", reason="fallback: offline"))}}}
    folder = domainfm.save_pretrained(model, tmp_path / "ft", report=report, arm="pretrained")
    lines = _section((folder / "README.md").read_text(), "Pretraining data")
    assert lines[0] == f"- weights: {OFFICIAL_URL}"
    assert lines[1].startswith("- pretraining data: TUEG (Temple University Hospital EEG Corpus)")
    assert lines[2].startswith("- overlaps with public benchmarks: TUAB, TUEV, ")
    assert "not a held-out result" in lines[2]
    # the random arm of the same run saw nothing
    random_card = hub.model_card_text(domainfm.create_model(folder), report, arm="random")
    assert _section(random_card, "Pretraining data") == [
        "- initialisation: random (the run's arm): no pretraining data"]
    # saved with no record of how it was made: the card's weights are named, with the caveat
    bare = _section((domainfm.save_pretrained(model, tmp_path / "bare") / "README.md").read_text(), "Pretraining data")
    assert bare[0].startswith(f"- weights: {OFFICIAL_URL} (assumed, the card's weights")
    assert "TUAB, TUEV" in bare[2]


def test_card_of_a_shipped_checkpoint_names_its_synthetic_data_and_no_overlaps(tmp_path):
    model = domainfm.create_model("wavetoken-micro.kernelsynth-tsmixup", pretrained=True)
    lines = _section((domainfm.save_pretrained(model, tmp_path / "wt") / "README.md").read_text(), "Pretraining data")
    assert lines[0] == ("- weights: package://domainfm.models.wavetoken/weights/"
                        "wavetoken-micro.kernelsynth-tsmixup.safetensors")
    assert "8,000 KernelSynth synthetic series" in lines[1] and "fertility (World Bank)" in lines[1]
    assert lines[2] == "- overlaps with public benchmarks: none known"


def test_every_published_weight_source_records_what_it_saw():
    """The registry is the one list: a weight source registered without its pretraining data fails here."""
    sources = {name: card["weights"] for manifest in zoo.manifests().values()
               for name, card in manifest["models"].items() if card["weights"]}
    assert {"cbramod-base", "fim-imputation-small", "wavetoken-micro", "git-small", "chronos-t5-tiny", "chronos-bolt-base",
            "explora-dinov2-vit-large", "explora-vit-large-mae-fmow-sentinel"} <= set(sources)
    missing = [(name, w["url"]) for name, ws in sources.items() for w in ws if not w["pretraining_data"]]
    assert not missing, f"weight sources without pretraining_data: {missing}"


def test_chronos_checkpoints_overlap_benchmark_i_and_not_their_zero_shot_benchmark():
    published = domainfm.list_models(["chronos-t5-*", "chronos-bolt-*"], pretrained=True)
    chronos = {n: zoo.weight_source(n) for n in published}
    assert len(chronos) == 9  # T5 tiny..large, Bolt tiny..base
    overlaps = {w.overlaps for w in chronos.values()}
    assert len(overlaps) == 1  # Bolt trained on the same real datasets (amazon-science/chronos-forecasting#245)
    (names,) = overlaps
    benchmark_i = [n for n in names if n != "GIFT-Eval"]
    assert len(benchmark_i) == len(CHRONOS_IN_DOMAIN_IDS) == 15

    def key(text: str) -> str:  # "M4 (Daily)" / "m4_daily", "Electricity (15 Min.)" / "electricity_15min"
        return "".join(c for c in text.lower().replace("monash_", "") if c.isalnum())

    assert sorted(map(key, benchmark_i)) == sorted(map(key, CHRONOS_IN_DOMAIN_IDS))
    # Benchmark II (zero-shot) datasets were held out of training
    assert not {"exchangerate", "traffic", "tourismmonthly", "m4quarterly"} & set(map(key, names))


def test_an_extended_checkpoint_overlaps_everything_its_start_saw():
    """ExPLoRA continues pretraining from DINOv2 / MAE: its result saw the start's data and the satellite set."""
    pairs = {"explora-vit-base-dinov2-fmow-rgb": ("explora-dinov2-vit-base", "fMoW-RGB"),
             "explora-vit-large-dinov2-fmow-rgb": ("explora-dinov2-vit-large", "fMoW-RGB"),
             "explora-vit-large-mae-fmow-sentinel": ("explora-mae-vit-large", "fMoW-Sentinel")}
    for result, (start, satellite) in pairs.items():
        result_w, start_w = zoo.weight_source(result), zoo.weight_source(start)
        assert set(start_w.overlaps) < set(result_w.overlaps), result
        assert satellite in result_w.overlaps and satellite not in start_w.overlaps, result
        assert start_w.pretraining_data in result_w.pretraining_data, result
    assert "ImageNet-1k" in zoo.weight_source("explora-mae-vit-base").overlaps
    assert "LVD-142M" in zoo.weight_source("explora-dinov2-vit-small").pretraining_data
