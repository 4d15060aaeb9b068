"""Wearables data: every Apple Health rule on hand-written exports, bad and malicious files, the
Fitbit / long-table / actigraphy readers, participant-weeks (one participant's from any source, a
cohort's, from ``.npz`` with their labels, split by participant) and the hand-made week features."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from domainfm.data_loaders import wearables as W
from domainfm.models.wearables import DEFAULT_VARIABLES

HEADER = """<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE HealthData [
<!ELEMENT HealthData (ExportDate,Me,(Record|Workout)*)>
<!ATTLIST HealthData locale CDATA #REQUIRED>
<!ELEMENT Record ((MetadataEntry|HeartRateVariabilityMetadataList)*)>
<!ATTLIST Record type CDATA #REQUIRED unit CDATA #IMPLIED value CDATA #IMPLIED sourceName CDATA #REQUIRED
  startDate CDATA #REQUIRED endDate CDATA #REQUIRED>
]>
<HealthData locale="en_GB">
 <ExportDate value="2024-01-10 09:00:00 +0000"/>
 <Me HKCharacteristicTypeIdentifierDateOfBirth="1980-01-01"/>
"""
HK = "HKQuantityTypeIdentifier"


def rec(kind, start, end, value, unit="count", source="Watch", *, children=""):
    t = kind if kind.startswith("HK") else HK + kind
    unit_attr = f' unit="{unit}"' if unit is not None else ""
    body = f">{children}</Record>" if children else "/>"
    return (f' <Record type="{t}" sourceName="{source}"{unit_attr} creationDate="{end}" startDate="{start}" '
            f'endDate="{end}" value="{value}"{body}\n')


def export(tmp_path, *records, name="export.xml", header=HEADER):
    path = tmp_path / name
    path.write_text(header + "".join(records) + "</HealthData>\n", encoding="utf-8")
    return path


def hour(table, stamp, column):
    return table.loc[pd.Timestamp(stamp), column]


def test_variables_are_the_models_default_input():
    assert W.VARIABLES == DEFAULT_VARIABLES


def test_cumulative_split_across_hours_and_midnight(tmp_path):
    path = export(tmp_path,
                  rec("StepCount", "2024-01-01 09:50:00 +0000", "2024-01-01 10:10:00 +0000", 100),
                  rec("StepCount", "2024-01-01 23:45:00 +0000", "2024-01-02 01:15:00 +0000", 900),
                  rec("StepCount", "2024-01-01 12:00:00 +0000", "2024-01-01 12:00:00 +0000", 7),  # instant
                  rec("DistanceWalkingRunning", "2024-01-01 10:30:00 +0000", "2024-01-01 11:30:00 +0000", 2.0,
                      unit="mi"))
    t = W.read_healthkit(path, variables=["steps", "distance_km"])
    assert list(t.columns) == ["steps", "distance_km"]
    assert t.index[0] == pd.Timestamp("2024-01-01 09:00") and t.index[-1] == pd.Timestamp("2024-01-02 01:00")
    assert t.index.tz is None and len(t) == 17  # every hour from the first to the last record
    assert hour(t, "2024-01-01 09:00", "steps") == pytest.approx(50)
    assert hour(t, "2024-01-01 10:00", "steps") == pytest.approx(50)
    assert hour(t, "2024-01-01 12:00", "steps") == pytest.approx(7)
    assert hour(t, "2024-01-01 23:00", "steps") == pytest.approx(150)  # 15 of 90 minutes
    assert hour(t, "2024-01-02 00:00", "steps") == pytest.approx(600)  # 60 of 90, next day
    assert hour(t, "2024-01-02 01:00", "steps") == pytest.approx(150)
    assert hour(t, "2024-01-01 10:00", "distance_km") == pytest.approx(1.609344)  # mi -> km, half of it
    assert hour(t, "2024-01-01 11:00", "distance_km") == pytest.approx(1.609344)
    # NaN, never 0, for hours without a record of that variable
    assert np.isnan(hour(t, "2024-01-01 14:00", "steps")) and np.isnan(hour(t, "2024-01-01 09:00", "distance_km"))
    assert t["steps"].sum() == pytest.approx(1007)


def test_one_source_per_hour_for_cumulative_quantities(tmp_path):
    path = export(tmp_path,
                  rec("StepCount", "2024-01-01 08:00:00 +0000", "2024-01-01 08:30:00 +0000", 300, source="iPhone"),
                  rec("StepCount", "2024-01-01 08:30:00 +0000", "2024-01-01 08:40:00 +0000", 100, source="iPhone"),
                  rec("StepCount", "2024-01-01 08:05:00 +0000", "2024-01-01 08:35:00 +0000", 350, source="Watch"),
                  rec("StepCount", "2024-01-01 09:00:00 +0000", "2024-01-01 09:10:00 +0000", 80, source="Watch"),
                  rec("StepCount", "2024-01-01 09:20:00 +0000", "2024-01-01 09:30:00 +0000", 60, source="iPhone"))
    t = W.read_healthkit(path, variables=["steps"])
    assert hour(t, "2024-01-01 08:00", "steps") == pytest.approx(400)  # iPhone's 400 > Watch's 350, never 750
    assert hour(t, "2024-01-01 09:00", "steps") == pytest.approx(80)   # Watch's 80 > iPhone's 60, never 140


def test_samples_are_means_of_samples_starting_in_the_hour_with_unit_conversion(tmp_path):
    path = export(tmp_path,
                  rec("HeartRate", "2024-01-01 08:10:00 +0000", "2024-01-01 08:10:00 +0000", 60, unit="count/min"),
                  rec("HeartRate", "2024-01-01 08:50:00 +0000", "2024-01-01 09:20:00 +0000", 90, unit="count/min",
                      source="iPhone"),
                  rec("HeartRate", "2024-01-01 09:30:00 +0000", "2024-01-01 09:30:00 +0000", 1.5, unit="count/s"),
                  rec("OxygenSaturation", "2024-01-01 08:00:00 +0000", "2024-01-01 08:00:00 +0000", 0.97, unit="%"),
                  rec("OxygenSaturation", "2024-01-01 08:30:00 +0000", "2024-01-01 08:30:00 +0000", 0.95, unit="%"),
                  rec("BodyMass", "2024-01-01 08:00:00 +0000", "2024-01-01 08:00:00 +0000", 154.0, unit="lb"),
                  rec("AppleSleepingWristTemperature", "2024-01-01 08:00:00 +0000", "2024-01-01 08:00:00 +0000",
                      95.0, unit="degF"),
                  rec("ActiveEnergyBurned", "2024-01-01 08:00:00 +0000", "2024-01-01 08:10:00 +0000", 41.84,
                      unit="kJ"),
                  rec("WalkingSpeed", "2024-01-01 08:00:00 +0000", "2024-01-01 08:00:00 +0000", 1.0, unit="m/s"),
                  rec("HeartRateVariabilitySDNN", "2024-01-01 08:00:00 +0000", "2024-01-01 08:01:00 +0000", 42,
                      unit="ms", children='<HeartRateVariabilityMetadataList><InstantaneousBeatsPerMinute bpm="60" '
                                          'time="8:00:01.00 AM"/></HeartRateVariabilityMetadataList>'))
    t = W.read_healthkit(path)
    assert list(t.columns) == list(W.VARIABLES)
    assert hour(t, "2024-01-01 08:00", "heart_rate") == pytest.approx(75)  # (60 + 90) / 2, both sources
    assert hour(t, "2024-01-01 09:00", "heart_rate") == pytest.approx(90)  # 1.5 count/s; not the 08:50 sample
    assert hour(t, "2024-01-01 08:00", "spo2") == pytest.approx(96)  # fractions -> %
    assert hour(t, "2024-01-01 08:00", "body_mass") == pytest.approx(154 * 0.45359237)
    assert hour(t, "2024-01-01 08:00", "wrist_temp") == pytest.approx(35.0)
    assert hour(t, "2024-01-01 08:00", "active_kcal") == pytest.approx(10.0)
    assert hour(t, "2024-01-01 08:00", "walking_speed") == pytest.approx(3.6)
    assert hour(t, "2024-01-01 08:00", "hrv_sdnn") == pytest.approx(42)
    assert t["steps"].isna().all() and t["vo2max"].isna().all()


def test_sleep_minutes_from_asleep_values_only(tmp_path):
    S = "HKCategoryTypeIdentifierSleepAnalysis"
    V = "HKCategoryValueSleepAnalysis"
    path = export(tmp_path,
                  rec(S, "2024-01-01 22:30:00 +0000", "2024-01-02 06:30:00 +0000", V + "InBed", unit=None,
                      source="iPhone"),
                  rec(S, "2024-01-01 23:10:00 +0000", "2024-01-01 23:40:00 +0000", V + "AsleepCore", unit=None),
                  rec(S, "2024-01-01 23:40:00 +0000", "2024-01-02 00:20:00 +0000", V + "AsleepDeep", unit=None),
                  rec(S, "2024-01-02 00:20:00 +0000", "2024-01-02 00:30:00 +0000", V + "Awake", unit=None),
                  rec(S, "2024-01-02 00:30:00 +0000", "2024-01-02 01:00:00 +0000", V + "AsleepREM", unit=None),
                  # the phone's legacy 'Asleep' overlaps the Watch's stages: counted once
                  rec(S, "2024-01-01 23:30:00 +0000", "2024-01-01 23:50:00 +0000", V + "Asleep", unit=None,
                      source="iPhone"),
                  rec(S, "2024-01-02 05:00:00 +0000", "2024-01-02 05:15:00 +0000", V + "AsleepUnspecified", unit=None))
    t = W.read_healthkit(path, variables=["sleep_min", "in_bed_min"])
    assert hour(t, "2024-01-01 22:00", "in_bed_min") == pytest.approx(30)
    assert np.isnan(hour(t, "2024-01-01 22:00", "sleep_min"))  # in bed, not asleep
    assert hour(t, "2024-01-01 23:00", "sleep_min") == pytest.approx(50)
    assert hour(t, "2024-01-02 00:00", "sleep_min") == pytest.approx(50)  # 20 + 30; the 10 awake minutes excluded
    assert hour(t, "2024-01-02 05:00", "sleep_min") == pytest.approx(15)
    assert hour(t, "2024-01-02 03:00", "in_bed_min") == pytest.approx(60)
    assert hour(t, "2024-01-02 06:00", "in_bed_min") == pytest.approx(30)
    assert t["sleep_min"].sum() == pytest.approx(115)


def test_mixed_utc_offsets_keep_local_wall_clock_and_dst_duration(tmp_path):
    path = export(tmp_path,
                  # travel: the same local evening hour in London and in New York
                  rec("StepCount", "2024-03-01 21:10:00 +0000", "2024-03-01 21:20:00 +0000", 10),
                  rec("StepCount", "2024-03-05 21:10:00 -0500", "2024-03-05 21:20:00 -0500", 20),
                  rec("HeartRate", "2024-03-05 03:30:00 +0530", "2024-03-05 03:30:00 +0530", 50, unit="count/min"),
                  # spans the autumn DST change (01:30 BST = 00:30 UTC; 01:10 GMT = 01:10 UTC): 40 min long
                  rec("StepCount", "2024-10-27 01:30:00 +0100", "2024-10-27 01:10:00 +0000", 400))
    t = W.read_healthkit(path, variables=["steps", "heart_rate"])
    assert hour(t, "2024-03-01 21:00", "steps") == 10
    assert hour(t, "2024-03-05 21:00", "steps") == 20  # 21:00 local in New York, not 02:00 the next day
    assert hour(t, "2024-03-05 03:00", "heart_rate") == 50
    assert hour(t, "2024-10-27 01:00", "steps") == pytest.approx(300)  # 30 of 40 minutes in local 01:xx
    assert hour(t, "2024-10-27 02:00", "steps") == pytest.approx(100)


def test_start_end_window(tmp_path):
    path = export(tmp_path, *[rec("StepCount", f"2024-01-0{d} 10:00:00 +0000", f"2024-01-0{d} 10:30:00 +0000", d)
                              for d in range(1, 6)])
    t = W.read_healthkit(path, variables=["steps"], start="2024-01-02", end="2024-01-04")
    assert t.index[0] >= pd.Timestamp("2024-01-02") and t.index[-1] < pd.Timestamp("2024-01-04")
    assert t["steps"].sum() == pytest.approx(5) and t["steps"].count() == 2


def test_malicious_external_entity_is_refused_and_never_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    header = HEADER.replace("]>", f'<!ENTITY xxe SYSTEM "file://{secret}">\n]>')
    path = export(tmp_path, rec("StepCount", "2024-01-01 10:00:00 +0000", "2024-01-01 10:05:00 +0000", "&xxe;"),
                  header=header)
    with pytest.raises(W.HealthDataError, match="entity 'xxe'") as err:
        W.read_healthkit(path)
    assert "TOP-SECRET" not in str(err.value)
    bomb = HEADER.replace("]>", '<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">\n]>')
    with pytest.raises(W.HealthDataError, match="entity 'a'"):
        W.read_healthkit(export(tmp_path, rec("StepCount", "2024-01-01 10:00:00 +0000", "2024-01-01 10:05:00 +0000",
                                              "&b;"), header=bomb, name="bomb.xml"))
    # an undeclared entity reference is an XML error, not a lookup on disk
    plain = export(tmp_path, rec("StepCount", "2024-01-01 10:00:00 +0000", "2024-01-01 10:05:00 +0000", "&xxe;"),
                   name="undeclared.xml")
    with pytest.raises(W.HealthDataError, match="undefined entity"):
        W.read_healthkit(plain)


def test_bad_files_raise_errors_naming_the_problem(tmp_path):
    other = tmp_path / "other.xml"
    other.write_text('<?xml version="1.0"?><gpx><trk/></gpx>')
    with pytest.raises(W.HealthDataError, match=r"other\.xml: root element is <gpx>.*not an Apple Health"):
        W.read_healthkit(other)
    good = export(tmp_path, rec("StepCount", "2024-01-01 10:00:00 +0000", "2024-01-01 10:05:00 +0000", 5) * 3)
    truncated = tmp_path / "truncated.xml"
    truncated.write_bytes(good.read_bytes()[:-40])
    with pytest.raises(W.HealthDataError, match=r"truncated\.xml: truncated XML at line"):
        W.read_healthkit(truncated)
    unit = export(tmp_path, rec("StepCount", "2024-01-01 10:00:00 +0000", "2024-01-01 10:05:00 +0000", 5,
                                unit="furlong"), name="unit.xml")
    with pytest.raises(W.HealthDataError, match=r"unit\.xml: HKQuantityTypeIdentifierStepCount record with "
                                                r"unit='furlong': expected one of \['count'\]"):
        W.read_healthkit(unit)
    date = export(tmp_path, rec("StepCount", "2024-01-01T10:00:00Z", "2024-01-01 10:05:00 +0000", 5), name="d.xml")
    with pytest.raises(W.HealthDataError, match="startDate='2024-01-01T10:00:00Z'"):
        W.read_healthkit(date)
    value = export(tmp_path, rec("HeartRate", "2024-01-01 10:00:00 +0000", "2024-01-01 10:00:00 +0000", "fast",
                                 unit="count/min"), name="v.xml")
    with pytest.raises(W.HealthDataError, match="value='fast'.*not a number"):
        W.read_healthkit(value)
    empty = tmp_path / "empty.xml"
    empty.write_text("")
    with pytest.raises(W.HealthDataError, match="empty.xml"):
        W.read_healthkit(empty)
    with pytest.raises(W.HealthDataError, match="no such file"):
        W.read_healthkit(tmp_path / "missing.xml")
    with pytest.raises(ValueError, match="unknown variable"):
        W.read_healthkit(good, variables=["stepz"])


@pytest.mark.parametrize("engine", ["fast", "expat"])
@pytest.mark.parametrize("field, bad", [("startDate", "+9999"), ("endDate", "+1500"), ("startDate", "-0260"),
                                        ("endDate", "+1401")])
def test_utc_offset_out_of_range_is_refused(tmp_path, engine, field, bad):
    start, end = "2024-01-01 10:00:00 +0000", "2024-01-01 10:05:00 +0000"
    start, end = (start[:-5] + bad, end) if field == "startDate" else (start, end[:-5] + bad)
    path = export(tmp_path, rec("StepCount", start, end, 5), name="offset.xml")
    with pytest.raises(W.HealthDataError, match=rf"offset\.xml: Record {field}='2024-01-01 10:0\d:00 \{bad}': UTC "
                                                r"offset .* out of range"):
        W.read_healthkit(path, engine=engine)
    # the real extremes (Baker Island -12:00, Kiribati's Line Islands +14:00, Nepal +05:45) are read
    ok = export(tmp_path, rec("StepCount", "2024-01-01 10:00:00 -1200", "2024-01-01 10:05:00 -1200", 5),
                rec("StepCount", "2024-01-01 11:00:00 +1400", "2024-01-01 11:05:00 +1400", 6),
                rec("StepCount", "2024-01-01 12:00:00 +0545", "2024-01-01 12:05:00 +0545", 7), name="extremes.xml")
    t = W.read_healthkit(ok, variables=["steps"], engine=engine)
    assert t["steps"].tolist() == pytest.approx([5, 6, 7])


def test_unzipped_export_folder_reads_as_its_export_xml(tmp_path):
    records = [rec("StepCount", "2024-01-01 09:50:00 +0100", "2024-01-01 10:10:00 +0100", 100),
               rec("HeartRate", "2024-01-01 09:10:00 +0100", "2024-01-01 09:10:00 +0100", 60, unit="count/min")]
    unzipped = tmp_path / "download" / "apple_health_export"
    unzipped.mkdir(parents=True)
    xml = export(unzipped, *records)
    (unzipped / "export_cda.xml").write_text("<ClinicalDocument/>")  # the other file of a real export
    direct = W.read_healthkit(xml, variables=["steps", "heart_rate"])
    for folder in (unzipped, unzipped.parent):  # the folder itself, or the one the zip was unpacked into
        assert W.healthkit_export_file(folder) == xml
        pd.testing.assert_frame_equal(W.read_healthkit(folder, variables=["steps", "heart_rate"]), direct)
    with pytest.raises(W.HealthDataError, match=r"apple_health_export: .*Apple Health export.*export\.xml"):
        W.read_fitbit(unzipped)
    assert W.healthkit_export_file(tmp_path / "download" / "nothing") is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(W.HealthDataError, match=r"empty: no export\.xml"):
        W.read_healthkit(tmp_path / "empty")


def test_small_batches_give_the_same_table(tmp_path):
    rng = np.random.default_rng(0)
    records = []
    for i in range(300):
        s = pd.Timestamp("2024-01-01") + pd.Timedelta(minutes=int(rng.integers(0, 5000)))
        e = s + pd.Timedelta(minutes=int(rng.integers(0, 90)))
        src = ["Watch", "iPhone"][i % 2]
        records.append(rec("StepCount", s.strftime("%Y-%m-%d %H:%M:%S +0000"), e.strftime("%Y-%m-%d %H:%M:%S +0000"),
                           int(rng.integers(0, 500)), source=src))
        records.append(rec("HeartRate", s.strftime("%Y-%m-%d %H:%M:%S +0000"), s.strftime("%Y-%m-%d %H:%M:%S +0000"),
                           int(rng.integers(50, 150)), unit="count/min"))
    path = export(tmp_path, *records)
    whole, stats = W.read_healthkit(path, variables=["steps", "heart_rate"], return_stats=True)
    pieces = W.read_healthkit(path, variables=["steps", "heart_rate"], batch_size=7)
    pd.testing.assert_frame_equal(whole, pieces)
    assert stats["records"] == 600 and stats["used"] == 600


# --------------------------------------------------------------------------- other formats


def test_read_long_csv_and_parquet(tmp_path):
    frame = pd.DataFrame({
        "timestamp": ["2024-01-01T08:05:00+01:00", "2024-01-01T08:50:00+01:00", "2024-01-01T08:15:00+01:00",
                      "2024-01-01T08:45:00+01:00", "2024-01-01 10:00:00"],
        "variable": ["steps", "steps", "heart_rate", "heart_rate", "steps"],
        "value": [100, 50, 60, 80, 7]})
    frame.to_csv(tmp_path / "long.csv", index=False)
    frame.to_parquet(tmp_path / "long.parquet")
    for name in ("long.csv", "long.parquet"):
        t = W.read_long(tmp_path / name)
        assert hour(t, "2024-01-01 08:00", "steps") == 150 and hour(t, "2024-01-01 08:00", "heart_rate") == 70
        assert np.isnan(hour(t, "2024-01-01 09:00", "steps")) and hour(t, "2024-01-01 10:00", "steps") == 7
    with pytest.raises(W.HealthDataError, match="no known aggregation"):
        W.read_long(frame.assign(variable="mystery"))
    assert W.read_long(frame.assign(variable="mystery"), kinds={"mystery": "sample"})["mystery"].iloc[0] == 72.5
    with pytest.raises(W.HealthDataError, match=r"missing column\(s\) \['value'\]"):
        W.read_long(frame.drop(columns="value"))


def test_minute_actigraphy_to_hours():
    minutes = pd.date_range("2024-01-01 00:00", periods=180, freq="min")
    frame = pd.DataFrame({"timestamp": minutes, "activity": np.arange(180.0), "hr": 60.0,
                          "asleep": (minutes.hour == 0).astype(int)})
    frame = frame.drop(index=range(120, 170))  # only 10 minutes recorded in the third hour
    t = W.aggregate_minutes(frame, cumulative=["activity"], samples=["hr"], sleep="asleep")
    assert t.loc["2024-01-01 00:00", "activity"] == sum(range(60))
    assert t.loc["2024-01-01 01:00", "activity"] == sum(range(60, 120))
    assert np.isnan(t.loc["2024-01-01 02:00", "activity"])  # 10 < 30 minutes worn
    assert t.loc["2024-01-01 00:00", "sleep_min"] == 60 and t.loc["2024-01-01 01:00", "sleep_min"] == 0
    assert t.loc["2024-01-01 01:00", "hr"] == 60


def test_read_fitbit_export(tmp_path):
    (tmp_path / "steps-2024-01-01.json").write_text(json.dumps(
        [{"dateTime": "01/01/24 08:00:00", "value": "30"}, {"dateTime": "01/01/24 08:59:00", "value": "20"},
         {"dateTime": "01/01/24 10:00:00", "value": "5"}]))
    (tmp_path / "heart_rate-2024-01-01.json").write_text(json.dumps(
        [{"dateTime": "01/01/24 08:00:05", "value": {"bpm": 60, "confidence": 2}},
         {"dateTime": "01/01/24 08:30:05", "value": {"bpm": 70, "confidence": 3}}]))
    (tmp_path / "distance-2024-01-01.json").write_text(json.dumps([{"dateTime": "01/01/24 08:00:00", "value": "150000"}]))
    (tmp_path / "sleep-2024-01-01.json").write_text(json.dumps([{
        "startTime": "2024-01-01T23:30:00.000", "endTime": "2024-01-02T01:00:00.000",
        "levels": {"data": [{"dateTime": "2024-01-01T23:30:00.000", "level": "wake", "seconds": 600},
                            {"dateTime": "2024-01-01T23:40:00.000", "level": "light", "seconds": 1800},
                            {"dateTime": "2024-01-02T00:10:00.000", "level": "deep", "seconds": 3000}]}}]))
    t = W.read_fitbit(tmp_path)
    assert hour(t, "2024-01-01 08:00", "steps") == 50 and hour(t, "2024-01-01 08:00", "heart_rate") == 65
    assert hour(t, "2024-01-01 08:00", "distance_km") == pytest.approx(1.5)
    assert np.isnan(hour(t, "2024-01-01 09:00", "steps"))
    assert hour(t, "2024-01-01 23:00", "sleep_min") == 20 and hour(t, "2024-01-02 00:00", "sleep_min") == 60
    assert hour(t, "2024-01-01 23:00", "in_bed_min") == 30
    (tmp_path / "steps-2024-02-01.json").write_text("[{\"dateTime\": \"01/02/24 08:00:00\", \"value\": \"x\"}]")
    with pytest.raises(W.HealthDataError, match="steps-2024-02-01.json"):
        W.read_fitbit(tmp_path)


# --------------------------------------------------------------------------- weeks


def test_to_weeks_shapes_zscore_and_mask():
    index = pd.date_range("2024-01-03 05:00", periods=24 * 10, freq="h")  # a Wednesday, 10 days
    rng = np.random.default_rng(0)
    table = pd.DataFrame({"steps": rng.poisson(100, len(index)).astype(float), "heart_rate": 70.0}, index=index)
    table.iloc[::5, 0] = np.nan
    weeks = W.to_weeks(table)
    values, observed, starts = weeks
    assert values.shape == (2, 168, 2) and observed.shape == (2, 168, 2) and values.dtype == np.float32
    assert list(starts) == [pd.Timestamp("2024-01-01"), pd.Timestamp("2024-01-08")]  # Mondays
    # hour 2*24 + 5 of the first week is the table's first hour
    assert observed[0, :53].sum() == 0 and observed[0, 53, 1]
    assert observed[0, 53, 0] == np.isfinite(table.iloc[0, 0])
    mean, std = np.nanmean(table["steps"]), np.nanstd(table["steps"])
    row = table.index.get_loc(pd.Timestamp("2024-01-04 07:00"))  # observed (every 5th row is NaN)
    assert np.isfinite(table.iloc[row, 0])
    np.testing.assert_allclose(values[0, 3 * 24 + 7, 0], (table.iloc[row, 0] - mean) / std, rtol=1e-5)
    assert (values[~observed] == 0).all()
    assert weeks.stats.std[1] == 1.0  # a constant variable is left unscaled
    # stats from a model apply unchanged
    again = W.to_weeks(table, stats=weeks.stats)
    np.testing.assert_array_equal(again.values, values)


def tricky_records() -> list[str]:
    """466 records (and two other elements) in every form a Record tag may take: character
    references and the five entities in attribute values, other attribute orders, single quotes,
    extra spaces and line breaks inside a tag, children, other elements, unwanted types."""
    rng = np.random.default_rng(1)
    lines = [' <Workout workoutActivityType="HKWorkoutActivityTypeRunning" duration="30" '
             'startDate="2024-01-01 06:00:00 +0000" endDate="2024-01-01 06:30:00 +0000"/>\n',
             ' <ActivitySummary dateComponents="2024-01-01" activeEnergyBurned="400"/>\n']
    for i in range(400):
        s = pd.Timestamp("2024-01-01") + pd.Timedelta(minutes=int(rng.integers(0, 6000)))
        e = s + pd.Timedelta(minutes=int(rng.integers(0, 120)))
        off = ["+0000", "+0100", "-0500"][i % 3]
        sd, ed = s.strftime("%Y-%m-%d %H:%M:%S ") + off, e.strftime("%Y-%m-%d %H:%M:%S ") + off
        form = i % 6
        src = ["Watch", "iPhone", "Jo&apos;s &amp; &#x41;pp", "&#87;atch"][i % 4]  # &#87; is 'W': the same source
        if form == 0:
            lines.append(rec("StepCount", sd, ed, int(rng.integers(0, 900)), source=src))
        elif form == 1:  # another attribute order, single quotes, a line break inside the tag
            lines.append(f" <Record value='{rng.integers(40, 160)}' unit=\"count/min\"\n   "
                         f"startDate='{sd}' endDate=\"{ed}\" sourceName='{src}' "
                         f"type=\"HKQuantityTypeIdentifierHeartRate\" ></Record>\n")
        elif form == 2:  # a value written with character references, children
            lines.append(rec("DistanceWalkingRunning", sd, ed, "&#49;.&#x35;", unit="mi", source=src,
                             children='<MetadataEntry key="k" value="a &lt; b"/>'))
        elif form == 3:
            stage = ["AsleepCore", "InBed", "Awake", "AsleepREM"][i % 4]
            lines.append(rec("HKCategoryTypeIdentifierSleepAnalysis", sd, ed, "HKCategoryValueSleepAnalysis" + stage,
                             unit=None, source=src))
        elif form == 4:  # a type not read, and the canonical form with the optional attributes
            lines.append(rec("DietaryWater", sd, ed, 250, unit="mL", source=src))
            lines.append(f' <Record type="HKQuantityTypeIdentifierActiveEnergyBurned" sourceName="{src}" '
                         f'sourceVersion="10.1" device="&lt;&lt;HKDevice: 0x1&gt;, name:Apple Watch&gt;" unit="kJ" '
                         f'creationDate="{ed}" startDate="{sd}" endDate="{ed}" value="{rng.uniform(0, 40):.3f}"/>\n')
        else:
            lines.append(rec("OxygenSaturation", sd, sd, round(float(rng.uniform(0.9, 1.0)), 3), unit="%",
                             source=src))
    return lines


def test_fast_engine_equals_expat_on_tricky_exports(tmp_path):
    """The regex fast path against expat (the reference engine) on an export with every form a
    Record tag may take: character references and the five entities in attribute values, other
    attribute orders, single quotes, extra spaces and line breaks inside a tag, children, other
    elements, unwanted types, and enough records to cut tags at chunk boundaries."""
    import domainfm.data_loaders.wearables as module

    lines = tricky_records()
    path = export(tmp_path, *lines)
    reference, ref_stats = W.read_healthkit(path, engine="expat", return_stats=True)
    original = module._CHUNK
    try:
        for chunk in (original, 1000, 173):  # small chunks: tags cut at many boundaries
            module._CHUNK = chunk
            fast, stats = W.read_healthkit(path, return_stats=True, batch_size=50)
            assert stats["engine"] == "fast" and stats["records"] == ref_stats["records"] == 466
            assert stats["used"] == ref_stats["used"]
            pd.testing.assert_frame_equal(fast, reference, check_exact=False, rtol=1e-12)
    finally:
        module._CHUNK = original
    one = export(tmp_path, rec("DistanceWalkingRunning", "2024-01-01 10:00:00 +0000", "2024-01-01 10:10:00 +0000",
                               "&#49;.&#x35;", unit="mi", source="A &amp; B"), name="one.xml")
    assert W.read_healthkit(one)["distance_km"].iloc[0] == pytest.approx(1.5 * 1.609344)  # '1.5' miles
    assert np.isfinite(reference[["steps", "heart_rate", "sleep_min", "spo2", "active_kcal"]]).any().all()
    # a comment in the body is valid XML the fast path does not read itself: expat reads the file
    commented = export(tmp_path, "<!-- a comment -->\n", *lines, name="commented.xml")
    table, stats = W.read_healthkit(commented, return_stats=True)
    assert stats["engine"] == "expat"
    pd.testing.assert_frame_equal(table, reference)
    # an entity declaration in the body is refused by the fast path itself
    declared = export(tmp_path, *lines[:50], '<!ENTITY x SYSTEM "file:///etc/passwd">\n', *lines[50:],
                      name="declared.xml")
    with pytest.raises(W.HealthDataError, match="entity 'x'"):
        W.read_healthkit(declared)


def test_handmade_features_mean_sd_and_cosinor_amplitude():
    hours = np.arange(168)
    v0 = 5 + 3 * np.cos(2 * np.pi * (hours % 24) / 24 - 1.0)  # amplitude 3 around 5
    values = np.stack([v0, np.full(168, 2.0)], -1)[None]
    observed = np.ones_like(values, dtype=bool)
    observed[0, ::3, 0] = False
    f = W.handmade_features(np.where(observed, values, 0.0), observed)
    assert f.shape == (1, 6)
    kept = v0[observed[0, :, 0]]
    np.testing.assert_allclose(f[0, 0], kept.mean())
    np.testing.assert_allclose(f[0, 2], kept.std())
    np.testing.assert_allclose(f[0, 4], 3.0, rtol=1e-4)  # the cosinor amplitude, despite the gaps
    np.testing.assert_allclose(f[0, [1, 3, 5]], [2.0, 0.0, 0.0], atol=1e-6)


def _long(table: pd.DataFrame) -> pd.DataFrame:
    return table.rename_axis("timestamp").reset_index().melt("timestamp", var_name="variable").dropna()


def test_participant_weeks_from_any_source_are_the_tables_unscaled_weeks(tmp_path):
    index = pd.date_range("2024-01-01", periods=24 * 12, freq="h")
    rng = np.random.default_rng(1)
    table = pd.DataFrame({"steps": rng.poisson(200, len(index)).astype(float),
                          "heart_rate": rng.normal(70, 5, len(index))}, index=index)
    table.iloc[24 * 7 + 30:, 0] = np.nan  # week 2: heart rate only, 5 days
    _long(table).to_csv(tmp_path / "p.csv", index=False)
    variables = ["heart_rate", "steps", "sleep_min"]  # the model's order; sleep_min is in no source
    for source in (tmp_path / "p.csv", _long(table), table):
        weeks = W.participant_weeks(source, variables, min_hours=24)
        assert weeks.values.shape == (2, 168, 3) and list(weeks.week_starts) == [index[0], index[168]]
        np.testing.assert_allclose(weeks.values[0, :, 0], table["heart_rate"].iloc[:168], rtol=1e-6)  # unscaled
        np.testing.assert_allclose(weeks.values[0, :, 1], table["steps"].iloc[:168], rtol=1e-6)
        assert weeks.observed[1, :, 1].sum() == 30 and not weeks.observed[..., 2].any()
    assert len(W.participant_weeks(table, variables, min_hours=150)) == 1  # week 2 has 120 observed hours
    with pytest.raises(W.HealthDataError, match="no week with at least 200 observed hours"):
        W.participant_weeks(table, variables, min_hours=200)
    with pytest.raises(W.HealthDataError, match=r"none of the model's variables \['spo2'\]"):
        W.participant_weeks(tmp_path / "p.csv", ["spo2"])
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(W.HealthDataError, match=r"p\.json: expected an Apple Health export\.zip, its export\.xml.*got '\.json'"):
        W.participant_weeks(tmp_path / "p.json", variables)


def test_cohort_weeks_zscore_fit_and_participant_split():
    rng = np.random.default_rng(2)
    tables = [pd.DataFrame({"steps": rng.poisson(100 + 50 * i, 24 * 14).astype(float)},
                           index=pd.date_range("2024-01-01", periods=24 * 14, freq="h")) for i in range(10)]
    tables[3] = tables[3].iloc[:24 * 7]  # one week only
    values, observed, participant, week_start = W.cohort_weeks(tables, ["steps"], min_hours=24)
    assert values.shape == (19, 168, 1) and observed.all()
    np.testing.assert_array_equal(participant, np.repeat(np.arange(10), [2, 2, 2, 1, 2, 2, 2, 2, 2, 2]))
    np.testing.assert_allclose(values[6, :, 0], tables[3]["steps"])  # participant 3's only week, unscaled
    assert list(week_start[:3]) == [pd.Timestamp("2024-01-01"), pd.Timestamp("2024-01-08"), pd.Timestamp("2024-01-01")]
    observed[0, :100] = False
    stats = W.ZScoreStats.fit_weeks(values, observed, ["steps"])
    seen = values[observed]
    np.testing.assert_allclose([stats.mean[0], stats.std[0]], [seen.mean(), seen.std()], rtol=1e-6)
    split = W.split_participants(participant, val_fraction=0.2, test_fraction=0.3, seed=0)
    assert sorted(np.concatenate(list(split.values()))) == list(range(19))  # every week in one split
    people = {k: set(participant[v]) for k, v in split.items()}
    assert [len(people[k]) for k in ("train", "val", "test")] == [5, 2, 3]
    assert not (people["train"] & people["val"]) and not (people["train"] & people["test"])
    assert not (people["val"] & people["test"])
    with pytest.raises(ValueError, match="3 participants are too few"):
        W.split_participants(np.arange(3), val_fraction=0.5, test_fraction=0.4, seed=0)


def test_weeks_npz_and_labels(tmp_path):
    raw = np.arange(4 * 168 * 2, dtype=np.float32).reshape(4, 168, 2)
    raw[1, 5, 0] = np.nan
    participant = np.array([7, 7, 9, 7])
    np.savez(tmp_path / "w.npz", values=raw, participant=participant)
    values, observed, who, variables = W.read_weeks_npz(tmp_path / "w.npz", ["a", "b"])
    assert variables == ["a", "b"] and values.dtype == np.float32 and (who == participant).all()
    assert not observed[1, 5, 0] and values[1, 5, 0] == 0 and observed.sum() == raw.size - 1
    np.testing.assert_array_equal(values[observed], raw[observed])
    np.savez(tmp_path / "named.npz", values=raw, participant=participant, variables=np.array(["x", "y"]))
    assert W.read_weeks_npz(tmp_path / "named.npz", ["a", "b"])[3] == ["x", "y"]  # the file's names win
    assert W.read_weeks_npz(tmp_path / "w.npz")[3] == ["var0", "var1"]
    np.savez(tmp_path / "bad.npz", values=raw[:, :100], participant=participant)
    with pytest.raises(W.HealthDataError, match=r"bad\.npz: values \(4, 100, 2\).*expected \(N, 168, V\)"):
        W.read_weeks_npz(tmp_path / "bad.npz")
    np.savez(tmp_path / "none.npz", values=raw)
    with pytest.raises(W.HealthDataError, match=r"missing array\(s\) \['participant'\]"):
        W.read_weeks_npz(tmp_path / "none.npz")
    pd.DataFrame({"participant": [9, 7], "fit": [1, 0]}).to_csv(tmp_path / "l.csv", index=False)
    pd.DataFrame({"participant": [7, 7, 9], "week": [2, 0, 0], "tired": [1, 0, 1]}).to_csv(tmp_path / "wk.csv",
                                                                                           index=False)
    labels, weekly = W.read_labels(tmp_path / "l.csv", participant, tmp_path / "wk.csv")
    assert labels["fit"].to_dict() == {9: 1, 7: 0}
    # weeks of 7: its 0th, 1st, 2nd week; the 1st has no label
    np.testing.assert_array_equal(weekly["tired"].to_numpy(), [0, np.nan, 1, 1])
    assert W.read_labels(tmp_path / "l.csv", participant)[1].shape == (4, 0)
    pd.DataFrame({"id": [1]}).to_csv(tmp_path / "x.csv", index=False)
    with pytest.raises(W.HealthDataError, match="no 'participant' column"):
        W.read_labels(tmp_path / "x.csv", participant)
