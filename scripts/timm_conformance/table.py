"""Markdown table (model x test group) from the JUnit XML of a run.sh run: pass / skip / FAIL.

    python scripts/timm_conformance/table.py /tmp/timm_conformance_junit.xml
"""
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

GROUPS = {  # timm test function -> column
    "test_model_forward": "forward",
    "test_model_backward": "backward",
    "test_model_default_cfgs": "cfgs",
    "test_model_default_cfgs_non_std": "cfgs",
    "test_model_forward_features": "features_only",
    "test_model_forward_intermediates_features": "features (getter)",
    "test_model_forward_intermediates": "forward_intermediates",
    "test_prune_intermediate_layers_contract": "prune",
    "test_model_forward_fx": "fx forward",
    "test_model_backward_fx": "fx backward",
    "test_model_forward_torchscript": "torchscript",
    "test_model_forward_fx_torchscript": "fx + torchscript",
}


def main(path):
    cells, reasons = defaultdict(dict), {}
    for case in ET.parse(path).getroot().iter("testcase"):
        match = re.fullmatch(r"(\w+)\[(?:\d+-)?(.+)\]", case.get("name"))
        if not match:
            continue
        test, model = match.groups()
        if case.find("failure") is not None or case.find("error") is not None:
            status = "FAIL"
        elif (skip := case.find("skipped")) is not None:
            reasons.setdefault(skip.get("message", ""), f"skip{len(reasons) + 1}")
            status = reasons[skip.get("message", "")]
        else:
            status = "pass"
        cells[model][GROUPS.get(test, test)] = status
    columns = list(dict.fromkeys(GROUPS.values()))
    print("| model | " + " | ".join(columns) + " |")
    print("| --- " * (len(columns) + 1) + "|")
    for model in sorted(cells, key=str.lower):
        print(f"| `{model}` | " + " | ".join(cells[model].get(c, "n/a") for c in columns) + " |")
    for reason, label in reasons.items():
        print(f"\n{label}: {reason}")


if __name__ == "__main__":
    main(sys.argv[1])
