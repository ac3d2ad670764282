"""The training loop behind `lamina train` and the demo: batches from a data set, a progress bar
with loss and throughput, a JSON-lines log, a loss-curve PNG, checkpoints after every epoch and on
Ctrl-C, and exact resumption.

Shuffling and sampling draw from generators seeded by (seed, epoch) and (seed, epoch, batch,
the sample's place in its global batch), never from a running state nor from the process that
draws, so a run resumed from a checkpoint, with any number of data-parallel ranks, sees exactly
the batches the uninterrupted run would have seen.
"""
import json
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import InputError, TrainingStopped
from .io.arrays import load_feeds
from .io.checkpoint import load_checkpoint, save_checkpoint
from .io.model import remove_stale_temporaries, write_atomic
from .selection import Selection
from .sequence import Sequences

CHECKPOINT = "checkpoint.lamina"


class Samples:
    """A data set of `count` samples whose batches make_batch(index, randomness) builds (index:
    the batch's sample numbers; randomness: a BatchRandomness for what a batch draws)."""

    def __init__(self, count: int, make_batch: Callable) -> None:
        self.count, self.make_batch = int(count), make_batch

    def __len__(self) -> int:
        return self.count

    def batch(self, index, randomness):
        return self.make_batch(index, randomness)


class ArrayData:
    """Samples from an .npz file (lamina.io.arrays.load_feeds). Batches take whole samples
    (whole sequences)."""

    def __init__(self, net, path):
        self.net, self.arrays, self.count = net, {}, None
        for name, value in load_feeds(net, path).items():
            if isinstance(value, Selection):
                continue  # a selection belongs to a batch, not to samples
            n = value.num_sequences if isinstance(value, Sequences) else len(value)
            if self.count is not None and n != self.count:
                raise InputError(f"{path}: '{name}' holds {n} samples, the other arrays {self.count}")
            self.arrays[name], self.count = value, n
        if not self.arrays:
            raise InputError(f"{path}: no array of samples for an input of the model "
                             f"({', '.join(net.input_names)})")

    def __len__(self):
        return self.count

    def batch(self, index, randomness):
        feeds = {}
        for name, value in self.arrays.items():
            if isinstance(value, Sequences):
                feeds[name] = Sequences.from_list([value.values[value.starts[i]:value.starts[i + 1]] for i in index])
            else:
                feeds[name] = np.ascontiguousarray(value[index])
        return feeds


class TextData:
    """Python source for a language model of lamina.zoo.language: files cut into chunks."""

    def __init__(self, net, paths, chunk=48, num_sampled=128, shared_negatives=False):
        from .zoo import language
        self.net, self.language, self.num_sampled = net, language, num_sampled
        self.shared_negatives = shared_negatives
        tok = language.tokenizer(net)
        self.chunks = []
        for p in paths:
            try:
                text = Path(p).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"{p}: cannot read the text file ({e})") from None
            self.chunks += language.chunk(tok.encode(text), chunk)
        if not self.chunks:
            raise InputError(f"{', '.join(map(str, paths))}: no tokens to train on")

    def __len__(self):
        return len(self.chunks)

    def batch(self, index, randomness):
        return self.language.training_feeds(self.net, [self.chunks[i] for i in index], self.num_sampled,
                                            randomness, self.shared_negatives)


class BatchRandomness:
    """The generators one batch draws from: `shared`, the same for the whole global batch on
    every rank, and `samples`, one per sample of this rank's share, keyed by the sample's place
    in the global batch. What a sample draws does not depend on which rank draws it."""

    def __init__(self, seed, epoch, b, places):
        self.shared = np.random.default_rng([seed, epoch, b])
        self.samples = [np.random.default_rng([seed, epoch, b, int(place), 1]) for place in places]


def fit(net, data, optimizer, epochs=1, batch_size=32, folder=None, resume=False, seed=0, progress=True,
        max_steps=None, log=print, checkpoint_every=None, world=None):
    """Train; returns the list of per-step losses of this call (skipped steps have none). With
    `folder`, writes checkpoint.lamina (every epoch, every `checkpoint_every` steps and on
    Ctrl-C), log.jsonl (one line per step, flushed as it is written) and loss.png there;
    resume=True continues from its checkpoint (the caller built `optimizer` over the
    checkpoint's network: see `resume_from`), or resume=fields of one (epoch, batch). A step
    the optimizer skips for a non-finite loss or gradient (lamina.optim, `nonfinite`) is logged
    with "skipped"; one it applied anyway stops training with FloatingPointError.

    Data-parallel (`world`, a lamina.distributed.World, with the optimizer made data-parallel):
    `batch_size` is the global batch, which every rank draws from the same (seed, epoch)
    shuffle and shards; each shard's sampling and dropout draw from generators seeded by
    (seed, epoch, batch, rank), so a run is reproducible and a checkpoint resumes with any
    number of ranks. Losses are those of the global batch; rank 0 alone shows progress and
    writes the log, the checkpoints and the plot; Ctrl-C stops every rank after the same step."""
    from tqdm import tqdm
    lead = world is None or world.rank == 0  # the rank that shows progress and writes files
    folder = Path(folder) if folder else None
    if folder and lead:
        folder.mkdir(parents=True, exist_ok=True)
    per_epoch = math.ceil(len(data) / batch_size)
    total = per_epoch * epochs if max_steps is None else min(max_steps, per_epoch * epochs)
    fields = getattr(resume, "fields", resume)
    position = [fields["epoch"], fields["batch"]] if resume else [0, 0]  # the next batch
    done = position[0] * per_epoch + position[1]
    samples = 0  # seen by this call (batches differ in size: the last of an epoch is short)

    def checkpoint():
        if folder and lead:
            save_checkpoint(folder / CHECKPOINT, net, optimizer, epoch=position[0], batch=position[1], seed=seed)

    from .distributed import ShardedSampler  # imports no MPI
    sampler = ShardedSampler(len(data), batch_size, world, seed)
    if world is not None:  # a rank with other data or another plan would wait for the others forever
        world.agree({"the number of samples": len(data), "the global batch size": batch_size, "epochs": epochs,
                     "the seed": seed, "the step limit": -1 if max_steps is None else max_steps,
                     "the starting step": done})
    losses = []
    # line-buffered: each step's line reaches the file when it is written, so a killed run
    # leaves a log that ends at its last step
    if folder and lead:
        remove_stale_temporaries(folder)
        keep_log_until(folder / "log.jsonl", position)
    logfile = open(folder / "log.jsonl", "a", buffering=1) if folder and lead else None
    bar = tqdm(total=total, initial=min(done, total), unit="step", disable=not (progress and lead),
               mininterval=0.5)
    t0 = time.perf_counter()
    interrupt = _DeferredInterrupt()
    try:
        while position[0] < epochs and done < total:
            # between steps, so the checkpoint's position matches its parameters; every rank
            # stops after the same step
            interrupt.check(world)
            epoch, b = position
            if b >= per_epoch:  # an epoch ends: checkpoint
                position = [epoch + 1, 0]
                checkpoint()
                continue
            index = sampler.indices(epoch, b)
            randomness = BatchRandomness(seed, epoch, b, sampler.positions(epoch, b))
            if world is None:
                feeds = data.batch(index, randomness)
            elif len(index):
                net.seed([seed, epoch, b, world.rank, 1])  # dropout masks: drawn per rank
                feeds = data.batch(index, randomness)
            else:  # a short last batch left this rank no sample
                feeds = None
            loss = net.train_step(feeds, optimizer) if feeds is not None else net.idle_step(optimizer)
            skipped = optimizer.last_step_skipped
            if not skipped and not math.isfinite(loss):
                raise FloatingPointError(f"the loss became {loss} at epoch {epoch}, batch {b} and the step was "
                                         f"applied: lower the learning rate")
            position, done, samples = [epoch, b + 1], done + 1, samples + len(sampler.global_batch(epoch, b))
            if not skipped:
                losses.append(loss)
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}" if losses else "-",
                            skipped=optimizer.skipped_steps,
                            samples_s=f"{samples / (time.perf_counter() - t0):.0f}")
            if logfile:
                entry = {"step": optimizer.step_count, "epoch": epoch, "batch": b,
                         "loss": loss if math.isfinite(loss) else str(loss), "lr": optimizer.current_lr}
                logfile.write(json.dumps({**entry, "skipped": True} if skipped else entry) + "\n")
            if checkpoint_every and done % checkpoint_every == 0:
                checkpoint()
    except KeyboardInterrupt as e:
        bar.close()
        checkpoint()
        if world is not None:
            world.barrier("rank 0 to write the checkpoint")  # no rank leaves before it is written
        if folder and lead:
            signum = e.signum if isinstance(e, TrainingStopped) else signal.SIGINT
            by = f" by {signal.Signals(signum).name}" if signum != signal.SIGINT else ""
            log(f"interrupted{by}: checkpoint written to {folder / CHECKPOINT} (resume with --resume)")
        raise
    finally:
        interrupt.restore()
        bar.close()
        if logfile:
            logfile.close()
    checkpoint()
    if folder and lead:
        plot_losses(folder / "log.jsonl", folder / "loss.png")
    return losses


def keep_log_until(path, position):
    """Drop the lines of a log that come at or after `position` ([epoch, batch]: where training
    goes on), so a run resumed from its checkpoint logs the steps after it once: a run killed
    after its last checkpoint had logged them already."""
    if not path.exists():
        return
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
                before = [entry["epoch"], entry["batch"]] < list(position)
            except (ValueError, KeyError, TypeError):
                before = False  # a line cut short by the kill
            if before:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        write_atomic(path, "".join(kept).encode())


def resume_from(folder):
    """The checkpoint in `folder` (a lamina.io.Checkpoint: .net, .restore(optimizer), .fields)."""
    path = Path(folder) / CHECKPOINT
    if not path.exists():
        raise InputError(f"{path}: no checkpoint to resume from")
    return load_checkpoint(path)


def plot_losses(log_path, png_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps, losses = [], []
    with open(log_path) as f:
        for line in f:
            entry = json.loads(line)
            if not entry.get("skipped"):
                steps.append(entry["step"])
                losses.append(entry["loss"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="loss")
    if len(losses) >= 10:
        k = max(5, len(losses) // 50)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1:], smooth, lw=1.5, label=f"mean of {k}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    tmp = f"{png_path}.tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, png_path)


class _DeferredInterrupt:
    """Ctrl-C or SIGTERM during training takes effect between steps: the first signal is
    remembered and raised as TrainingStopped (a KeyboardInterrupt) at the next check, so a step
    is never cut between its parameter update and the position the checkpoint records (a
    checkpoint written then would repeat that step on resume). A second one interrupts at once. Only in the
    main thread (where Python delivers signals); elsewhere the signals behave as usual."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = None  # the signal that came
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._remember) for sig in self.SIGNALS}

    def _remember(self, signum, frame):
        if self.requested is not None:
            raise TrainingStopped(signum)
        self.requested = signum

    def check(self, world=None):
        """Raise TrainingStopped if a signal came (on any rank of `world`)."""
        requested = self.requested is not None
        if world.any(requested, "the other ranks between steps") if world is not None else requested:
            raise TrainingStopped(self.requested or signal.SIGINT)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
