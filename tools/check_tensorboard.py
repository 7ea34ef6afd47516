#!/usr/bin/env python3
"""Reads a titan run's TensorBoard event files back with the `tensorboard` package and checks them
against the run's metrics.jsonl: every step's loss, grad_norm, lr, tps, tflops, mfu, memory and time,
and val_loss / val_ppl where the run validated, equal to float32 precision.

  pip install tensorboard
  titan train --metrics.enable_tensorboard=true --job.dump_folder=RUN ...
  python3 tools/check_tensorboard.py RUN
"""
import glob
import json
import math
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAGS = {  # TensorBoard tag -> metrics.jsonl field
    "loss_metrics/global_avg_loss": "loss", "grad_norm": "grad_norm", "lr": "lr", "throughput(tps)": "tps",
    "tflops": "tflops", "mfu(%)": "mfu", "memory/max_reserved(GiB)": "mem_gib",
    "time_metrics/end_to_end(s)": "time_s", "validation_metrics/loss": "val_loss",
    "validation_metrics/perplexity": "val_ppl",
}


def main():
    run = sys.argv[1]
    records = {r["step"]: r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))}
    folders = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(run, "**", "events.out.tfevents.*"),
                                                            recursive=True)})
    assert folders, f"{run}: no event files"
    checked = 0
    for folder in folders:
        acc = EventAccumulator(folder, size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        for tag, field in TAGS.items():
            if field.startswith("val_") and tag not in tags:
                continue
            assert tag in tags, f"{folder}: no scalar '{tag}' (has {tags})"
            for ev in acc.Scalars(tag):
                want = records[ev.step][field]
                # metrics.jsonl rounds some fields to a few decimals; the event holds the float32 value.
                tol = max(abs(want) * 1e-6, 5e-3 if field in ("grad_norm", "tps", "mfu", "tflops", "mem_gib",
                                                              "time_s") else 0.0)
                assert math.isclose(ev.value, want, rel_tol=1e-6, abs_tol=tol), (tag, ev.step, ev.value, want)
                checked += 1
        print(f"{folder}: {len(tags)} scalar tags, steps {sorted({e.step for e in acc.Scalars(tags[0])})}")
    print(f"ok: {checked} scalars equal metrics.jsonl")


if __name__ == "__main__":
    main()
