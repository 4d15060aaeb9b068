"""Apple Health's ``export.zip`` read directly: its ``apple_health_export/export.xml`` streamed from
the archive gives exactly the table of the unzipped file (both engines), through the CLI too;
entity attacks inside it are refused as in the plain file; a zip without ``export.xml`` or a damaged
one is an error naming the zip; a highly compressed member (a zip bomb's shape) is streamed in
bounded memory."""
from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from domainfm.data_loaders import wearables as W

sys.path.insert(0, str(Path(__file__).parent))
from test_wearables import HEADER, export, rec, tricky_records  # noqa: E402  (the HealthKit fixtures)

MEMBER = "apple_health_export/export.xml"  # where the Health app puts it


def zip_export(xml: Path, zip_path: Path, *, compression=zipfile.ZIP_DEFLATED) -> Path:
    """An export.zip laid out as the Health app writes it: export.xml beside export_cda.xml and routes."""
    with zipfile.ZipFile(zip_path, "w", compression=compression) as z:
        z.writestr("apple_health_export/", "")
        z.write(xml, MEMBER)
        z.writestr("apple_health_export/export_cda.xml", "<ClinicalDocument/>")
        z.writestr("apple_health_export/workout-routes/route_2024-01-01_6.00am.gpx", "<gpx/>")
    return zip_path


@pytest.mark.parametrize("compression", [zipfile.ZIP_DEFLATED, zipfile.ZIP_STORED])
@pytest.mark.parametrize("engine", ["fast", "expat"])
def test_export_zip_reads_exactly_as_its_export_xml(tmp_path, engine, compression):
    xml = export(tmp_path, *tricky_records())
    archive = zip_export(xml, tmp_path / "export.zip", compression=compression)
    direct, direct_stats = W.read_healthkit(xml, engine=engine, return_stats=True)
    zipped, stats = W.read_healthkit(archive, engine=engine, return_stats=True)
    pd.testing.assert_frame_equal(zipped, direct)
    assert stats == direct_stats and stats["engine"] == engine and stats["records"] == 466
    assert stats["bytes"] == xml.stat().st_size  # the member's uncompressed size
    assert np.isfinite(direct[["steps", "heart_rate", "sleep_min", "spo2", "active_kcal"]]).any().all()


def test_zip_chunk_boundaries_and_handover_to_expat(tmp_path, monkeypatch):
    """Small chunks cut tags at many places inside the decompressed stream; a comment in the body
    sends the zipped file back to its start for expat (a backward seek in the member)."""
    lines = tricky_records()
    xml = export(tmp_path, *lines)
    reference = W.read_healthkit(xml, engine="expat")
    monkeypatch.setattr(W, "_CHUNK", 173)
    zipped, stats = W.read_healthkit(zip_export(xml, tmp_path / "export.zip"), return_stats=True, batch_size=50)
    assert stats["engine"] == "fast"
    pd.testing.assert_frame_equal(zipped, reference, check_exact=False, rtol=1e-12)
    commented = export(tmp_path, "<!-- a comment -->\n", *lines, name="commented.xml")
    table, stats = W.read_healthkit(zip_export(commented, tmp_path / "commented.zip"), return_stats=True)
    assert stats["engine"] == "expat"
    pd.testing.assert_frame_equal(table, reference)


@pytest.mark.parametrize("engine", ["fast", "expat"])
def test_entity_attacks_inside_the_zip_are_refused_like_the_plain_file(tmp_path, engine):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    step = rec("StepCount", "2024-01-01 10:00:00 +0000", "2024-01-01 10:05:00 +0000", "&xxe;")
    attacks = {
        "xxe": export(tmp_path, step, header=HEADER.replace("]>", f'<!ENTITY xxe SYSTEM "file://{secret}">\n]>'),
                      name="xxe.xml"),
        "bomb": export(tmp_path, step.replace("&xxe;", "&b;"), name="bomb.xml", header=HEADER.replace(
            "]>", '<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">\n]>')),
        # declared in the body, after 60 records: the fast path's own check, its line counted in the member
        "body": export(tmp_path, *tricky_records()[:60], '<!ENTITY x SYSTEM "file:///etc/passwd">\n',
                       *tricky_records()[60:], name="body.xml"),
    }
    for name, xml in attacks.items():
        text = xml.read_text()
        line = text[:text.index("<!ENTITY")].count("\n") + 1
        entity = text[text.index("<!ENTITY") + 9:].split()[0]
        expected = (f"line {line}: the XML declares entity '{entity}'; entity declarations are refused"
                    if name != "body" or engine == "fast" else  # expat: no declaration allowed in the body
                    f"malformed XML at line {line}, column 2: not well-formed")
        with pytest.raises(W.HealthDataError) as plain:
            W.read_healthkit(xml, engine=engine)
        assert str(plain.value).startswith(f"{xml}: {expected}")
        archive = zip_export(xml, tmp_path / f"{name}.zip")
        with pytest.raises(W.HealthDataError) as zipped:
            W.read_healthkit(archive, engine=engine)
        # the same message (same line), naming the zip and its member instead of the file
        assert str(zipped.value) == str(plain.value).replace(str(xml), f"{archive}/{MEMBER}")
        assert "TOP-SECRET" not in str(zipped.value)


def error(path, **kwargs) -> str:
    with pytest.raises(W.HealthDataError) as err:
        W.read_healthkit(path, **kwargs)
    return str(err.value)


def test_zip_without_export_xml_damaged_or_ambiguous_is_an_error_naming_it(tmp_path):
    xml = export(tmp_path, rec("StepCount", "2024-01-01 10:00:00 +0000", "2024-01-01 10:05:00 +0000", 5))
    other = tmp_path / "photos.zip"
    with zipfile.ZipFile(other, "w") as z:
        for i in range(7):
            z.writestr(f"IMG_{i}.jpg", b"\xff\xd8")
    assert error(other) == (f"{other}: no export.xml in this zip (expected {MEMBER}, as the Health app writes "
                            "export.zip); it holds IMG_0.jpg, IMG_1.jpg, IMG_2.jpg, IMG_3.jpg, IMG_4.jpg and 2 more")
    not_zip = tmp_path / "export.zip"
    not_zip.write_bytes(xml.read_bytes())
    assert error(not_zip).startswith(f"{not_zip}: not a readable zip archive (File is not a zip file)")
    good = zip_export(xml, tmp_path / "good.zip", compression=zipfile.ZIP_STORED)
    truncated = tmp_path / "truncated.zip"
    truncated.write_bytes(good.read_bytes()[:len(good.read_bytes()) // 2])
    assert error(truncated).startswith(f"{truncated}: not a readable zip archive")
    # one digit changed in the stored member: still valid XML, but the CRC at its end does not match
    data = good.read_bytes()
    at = data.index(b'value="5"') + len(b'value="')
    damaged = tmp_path / "damaged.zip"
    damaged.write_bytes(data[:at] + b"6" + data[at + 1:])
    for engine in ("fast", "expat"):
        assert error(damaged, engine=engine).startswith(f"{damaged}/{MEMBER}: damaged zip archive (Bad CRC-32")
    # the central directory's record of the member (PKWARE APPNOTE 4.3.12): flags at +8, method at +10
    entry = data.rindex(MEMBER.encode()) - 46  # its name follows the 46-byte fixed part
    assert data[entry:entry + 4] == b"PK\x01\x02"
    for name, offset, value, message in (("encrypted", 8, 1, "the member is encrypted"),
                                         ("deflate64", 10, 9, "That compression method is not supported")):
        patched = tmp_path / f"{name}.zip"
        patched.write_bytes(data[:entry + offset] + value.to_bytes(2, "little") + data[entry + offset + 2:])
        assert error(patched).startswith(f"{patched}/{MEMBER}: {message}")
    two = tmp_path / "two.zip"
    with zipfile.ZipFile(two, "w") as z:
        z.write(xml, "a/export.xml")
        z.write(xml, "b/export.xml")
    assert error(two).startswith(f"{two}: 2 export.xml files in this zip (a/export.xml, b/export.xml)")
    # re-zipped by hand: the one export.xml at another place (macOS's __MACOSX copy ignored)
    rezipped = tmp_path / "rezipped.zip"
    with zipfile.ZipFile(rezipped, "w") as z:
        z.write(xml, "download/apple_health_export/export.xml")
        z.writestr("__MACOSX/download/apple_health_export/export.xml", b"\x00\x05\x16\x07")
    pd.testing.assert_frame_equal(W.read_healthkit(rezipped), W.read_healthkit(xml))


def test_a_highly_compressed_member_is_streamed_in_bounded_memory(tmp_path):
    """A zip bomb's shape: 32 or 128 MiB of whitespace inside the root compress to a few hundred
    KiB. Reading it writes nothing to disk, and the memory it takes does not grow with the member
    (the fast path hands a long stretch with no tag to expat, which streams it)."""
    import tracemalloc

    body = rec("StepCount", "2024-01-01 10:00:00 +0000", "2024-01-01 10:05:00 +0000", 5)
    peaks = {}
    for mib in (32, 128):
        archive = tmp_path / f"bomb{mib}.zip"
        with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as z, z.open(MEMBER, "w") as member:
            member.write(HEADER.encode())
            blank = b" " * (1 << 20)
            for _ in range(mib):
                member.write(blank)
            member.write((body + "</HealthData>\n").encode())
        assert archive.stat().st_size < 1 << 20
        before = sorted(p.name for p in tmp_path.iterdir())
        tracemalloc.start()
        try:
            table, stats = W.read_healthkit(archive, variables=["steps"], return_stats=True)
            peaks[mib] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert table["steps"].tolist() == [5.0] and stats["bytes"] > mib << 20 and stats["engine"] == "expat"
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing unpacked beside it
    # bounded by the fast path's carry-over (16 MiB, x3 while joined), not by the member (was 3x the member)
    assert peaks[128] < 64 << 20 and abs(peaks[128] - peaks[32]) < 1 << 20, peaks


def test_predict_through_the_cli_reads_export_zip_like_export_xml(tmp_path, capsys):
    """``domainfm predict wearables --input export.zip``: the same weeks and probabilities as from the
    export.xml, and as the model applied to the hourly table those records make (built by hand)."""
    from domainfm import cli, create_model, save_pretrained

    model = create_model("wbm-test", n_chans=2, n_times=168, n_outputs=1, variables=["steps", "heart_rate"])
    save_pretrained(model, tmp_path / "m")
    hours = pd.date_range("2024-01-01", periods=14 * 24, freq="h")
    rng = np.random.default_rng(3)
    steps, heart = rng.integers(0, 900, len(hours)).astype(float), rng.integers(50, 120, len(hours)).astype(float)
    records = []
    for t, s, h in zip(hours, steps, heart):  # written in Paris time: each record stays in its local hour
        start, end = t.strftime("%Y-%m-%d %H:00:00 +0100"), t.strftime("%Y-%m-%d %H:10:00 +0100")
        records += [rec("StepCount", start, end, int(s)), rec("HeartRate", start, start, int(h), unit="count/min")]
    xml = export(tmp_path, *records)
    archive = zip_export(xml, tmp_path / "export.zip")
    outputs = {}
    for given in (xml, archive):
        out = tmp_path / f"{given.suffix[1:]}.csv"
        assert cli.main(["predict", "wearables", "--model", str(tmp_path / "m"), "--input", str(given), "--output",
                         str(out), "--precision", "32-true"]) == 0
        outputs[given.suffix] = pd.read_csv(out)
    pd.testing.assert_frame_equal(outputs[".zip"], outputs[".xml"])
    weeks = outputs[".zip"]
    assert list(weeks.columns) == ["week_start", "week_end", "hours_observed", "p_output"]
    assert weeks["week_start"].tolist() == ["2024-01-01", "2024-01-08"] and (weeks["hours_observed"] == 168).all()
    table = pd.DataFrame({"steps": steps, "heart_rate": heart}, index=hours)
    expected = W.participant_weeks(table, ["steps", "heart_rate"])
    with torch.no_grad():
        logits = model.eval()(torch.as_tensor(expected.values), torch.as_tensor(expected.observed), raw=True)
    np.testing.assert_allclose(weeks["p_output"], torch.sigmoid(logits).reshape(-1).numpy(), rtol=1e-5, atol=1e-6)
    # a zip that is not an Apple Health export: a one-line error naming it, no output written
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("notes.txt", "hello")
    assert cli.main(["predict", "wearables", "--model", str(tmp_path / "m"), "--input", str(other), "--output",
                     str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err
    assert f"{other}: no export.xml in this zip" in err and "notes.txt" in err and "Traceback" not in err
    assert not (tmp_path / "o.csv").exists()
