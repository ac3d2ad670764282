"""The networks and data of the shipped models (models/): built, fed and measured here, so the
training scripts, the demo, the command and the tests share one definition."""
import argparse
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
