"""The networks and data of the shipped models (models/): built, fed and measured here, so the
training scripts, the demo, the command and the tests share one definition."""
import argparse
import json
import os
from typing import Any, Callable, Optional


def script_options(doc: str, steps: int, out: Any, add: Optional[Callable[[argparse.ArgumentParser], None]] = None
                   ) -> argparse.Namespace:
    """The command line of a shipped model's training script, parsed: --steps (default `steps`),
    --out (default `out`), --threads, and whatever add(parser) adds. The thread count is applied
    and lamina's generator seeded with 0."""
    from .. import manual_seed, set_num_threads
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps, help="training steps (batches)")
    parser.add_argument("--out", default=str(out))
    parser.add_argument("--threads", type=int, default=None)
    if add is not None:
        add(parser)
    args = parser.parse_args()
    if args.threads:
        set_num_threads(args.threads)
    manual_seed(0)
    return args


def write_metrics(folder: Any, model: Any, losses: list, **figures: Any) -> None:
    """A shipped model's metrics.json in `folder`: the figures given, the mean training loss of
    the last 100 steps and the model file's size; says where the model was written."""
    size = os.path.getsize(model)
    record = {**figures, "final_train_loss": round(float(sum(losses[-100:]) / max(1, len(losses[-100:]))), 4),
              "size_bytes": size}
    with open(os.path.join(folder, "metrics.json"), "w") as f:
        f.write(json.dumps(record, indent=1) + "\n")
    print(f"wrote {model} ({size / 1e6:.1f} MB)")
