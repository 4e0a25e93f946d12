"""notebooks/serving_report.py on small documents built here (rows as benchmarks/serving.py writes them) and on
the committed serving results."""

import sys

import pytest

from moelab import results

sys.path.insert(0, str(results.REPO / "notebooks"))
import serving_report as sr  # noqa: E402


def prefill_doc(native_ms=50.0, share=0.5):
    base = {"model": "olmoe-1b-7b", "part": "prefill", "batch": 1, "length": 2048, "layers": 16, "layers_full": 16}
    rows = [{**base, "arm": "hf", "ms": 100.0}, {**base, "arm": "native", "ms": native_ms, "expert_share": share}]
    for arm, ms, kept in (("eak-75", 45.0, 0.75), ("ratio-75", 44.0, 0.75), ("eak-60", 40.0, 0.6),
                          ("ratio-60", 42.0, 0.6)):
        pred = share * (1 - kept)
        rows.append({**base, "arm": arm, "ms": ms, "kept_fraction": kept, "amdahl_saving": pred,
                     "saving_vs_native": 1 - ms / native_ms, "vs_amdahl": ms / (native_ms * (1 - pred)) - 1})
    return {"rows": rows}


def test_prefill_and_amdahl_targets():
    df = sr.frame([prefill_doc()])
    p = sr.prefill(df).iloc[0]
    assert (p["model"], p["shape"]) == ("OLMoE-1B-7B", "1x2048")
    assert p["speedup"] == pytest.approx(2.0) and p["met"]
    assert p["saving_75"] == pytest.approx(1 - 44 / 50) and p["saving_60"] == pytest.approx(0.2)  # the faster policy
    a = sr.amdahl(df).set_index(["policy", "keep"])
    assert a.loc[("EntropyAdaptiveK", 75), "vs_amdahl"] == pytest.approx(45 / 43.75 - 1)
    assert a["met"].all() and a["checked"].all()
    slow = sr.amdahl(sr.frame([prefill_doc(native_ms=37.0)])).set_index(["policy", "keep"])
    assert not slow.loc[("EntropyAdaptiveK", 75), "met"]  # 45 ms against 37 x (1 - 0.125): +39%
    assert sr.layers(df) == {"OLMoE-1B-7B": "all 16 layers"}


def test_frame_refuses_unknown_models_and_error_rows():
    doc = prefill_doc()
    with pytest.raises(ValueError, match=r"models \['tiny'\]: not serving models"):
        sr.frame([{"rows": doc["rows"] + [{"model": "tiny", "part": "prefill", "arm": "hf"}]}])
    with pytest.raises(ValueError, match="rows with errors"):
        sr.frame([{"rows": doc["rows"] + [{**doc["rows"][0], "arm": "eak-90", "error": "OutOfMemoryError"}]}])


def test_committed_serving_results():
    """The committed runs: every arm at every shape and batch, the Amdahl prediction as its formula gives it, and
    the pool arms' stress without a mismatch."""
    df = sr.frame()
    assert len(sr.prefill(df)) == 9 and len(sr.decode(df)) == 9
    a = df[(df["part"] == "prefill") & df["policy"].notna()]
    share = df[(df["part"] == "prefill") & (df["arm"] == "native")].set_index(["model", "shape"])["expert_share"]
    want = [share[m, s] * (1 - k) for m, s, k in zip(a["model"], a["shape"], a["kept_fraction"])]
    assert list(a["amdahl_saving"]) == pytest.approx(want)
    pool = sr.pool(df)
    assert (pool["stress_mismatches"] == 0).all() and (pool["scratch_fraction_in_pool"] == 1).all()
