"""scripts/check_fork_models.py on the SSD layer types: caffepar agrees with OpenCV's dnn module
(the independent reference) and with its own ONNX export in onnxruntime, one-layer net by
one-layer net."""
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cv2", reason="OpenCV (opencv-python-headless 4.x) is the reference here; "
                                  "it is not a caffepar dependency")
pytest.importorskip("onnxruntime")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import check_fork_models as script  # noqa: E402

SSD = ["Permute", "Normalize", "PriorBox", "DetectionOutput"]


def test_ssd_layers_agree_with_opencv_and_onnxruntime():
    rows = script.layer_rows(None, SSD)
    assert {r["item"].split()[0] for r in rows} == set(SSD)
    for row in rows:
        assert row["caffepar"].startswith("runs"), row
        assert row["caffepar_onnx"].startswith("agrees"), row
        if "OpenCV cannot load" in row["note"]:
            assert row["opencv"].startswith("fails"), row
        else:
            assert row["opencv"].startswith("agrees"), row


def test_a_type_this_build_lacks_is_reported_not_fatal(monkeypatch):
    monkeypatch.setattr(script, "LAYER_CASES", [script.LayerCase(
        "NoSuchForkLayer", "", {"x": (1, 2, 3, 3)})])
    row, = script.layer_rows(None, [])
    assert row["caffepar"] == "not in this build"
    assert row["opencv"].startswith("fails")


def test_published_ssd_models_agree_with_opencv():
    """MobileNet-SSD and the res10 face detector (random weights) where their prototxts are in
    the cache: caffepar's detections are OpenCV's, and its ONNX export's are caffepar's."""
    cache = script.cache_root()
    names = [p.name for p in script.PUBLISHED if (cache / p.file).exists()
             and p.name in ("MobileNet-SSD", "res10 SSD face detector")]
    if not names:
        pytest.skip(f"no published SSD prototxt in {cache} (the script's --fetch puts them there)")
    for row in script.model_rows(cache, None, names):
        assert row["caffepar"].startswith("runs"), row
        assert row["opencv"].startswith("agrees"), row
        assert row["caffepar_onnx"].startswith("agrees"), row


def test_fast_rcnn_zf_agrees_with_opencv():
    """py-faster-rcnn's ZF Fast R-CNN test prototxt (Dropout with scale_train: false,
    ROIPooling of valid regions, random N(0, 2/fan-in) weights) where it is in the cache:
    cls_prob and bbox_pred are OpenCV's (rtol 1e-4), and its ONNX export's."""
    cache = script.cache_root()
    if not (cache / "fast_rcnn_zf_test.prototxt").exists():
        pytest.skip(f"fast_rcnn_zf_test.prototxt (py-faster-rcnn's models/pascal_voc/ZF/"
                    f"fast_rcnn/test.prototxt) is not in {cache}")
    row, = script.model_rows(cache, None, ["Fast R-CNN ZF"])
    assert row["caffepar"] == "runs: output (8, 21), (8, 84)", row
    assert row["opencv"].startswith("agrees: cls_prob max abs diff"), row
    assert row["caffepar_onnx"].startswith("agrees"), row


def test_a_model_output_is_compared_against_its_scale():
    """A deep net's output agrees when it is within 1e-4 of its largest value, even where
    small elements differ by more than 1e-4 of themselves; a one-layer net's stays element by
    element."""
    want = np.array([8.0, 1e-3, -2.0])
    got = want + np.array([3e-4, 5e-5, 0.0])
    assert script.compare(got, want, False, scaled=True).startswith("agrees: max abs diff 0.0003")
    assert script.compare(got, want, False).startswith("differs")
    assert script.compare(want + 1e-3, want, False, scaled=True).startswith("differs")


def test_earlier_rows_that_share_a_label_are_all_kept(tmp_path, monkeypatch):
    """Two cases with the same label (Upsample twice) both keep their earlier rows when a run
    chooses neither."""
    cases = [script.LayerCase("Upsample", "upsample_param { scale: 2 }", {"x": (1, 3, 5, 6)},
                              note=note) for note in ("first", "second")]
    monkeypatch.setattr(script, "LAYER_CASES", cases)
    monkeypatch.setattr(script, "PUBLISHED", [])
    out = tmp_path / "rows"
    earlier = [{"item": "Upsample (scale: 2)", "kind": "layer", "caffepar": "runs", "note": n}
               for n in ("first", "second")]
    script.write(out, earlier, None)
    rows = script.with_earlier([], out)
    assert [r["note"] for r in rows] == ["first" + script.EARLIER, "second" + script.EARLIER]
