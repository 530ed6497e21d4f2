"""ResNet-18 on CIFAR-10, gossip-trained with dpwa: every node on its own shard of the training set.

Start it on every node of a cluster file::

    dpwa run samples/localhost.yaml examples/pytorch-cifar/train.py                      # real CIFAR-10
    dpwa run samples/localhost.yaml examples/pytorch-cifar/train.py --synthetic --steps 3  # no torchvision

``dpwa run`` sets ``DPWA_NODE`` (this node's name), ``DPWA_CONFIG`` (the cluster file) and ``DPWA_RUN_DIR``;
``--name`` / ``--config`` / ``--run-dir`` override them.  Node ``i`` of ``n`` (``i`` = its index in the
cluster file's ``nodes``) trains on samples ``i, i+n, i+2n, ...`` of the training set; shards are disjoint
and cover the set.

Around every batch: ``conn.update_send(previous loss)``, one SGD step, ``conn.update_wait(loss)``.  The
adapter logs every exchange to ``<run_dir>/<node>.metrics.jsonl``; this script logs progress to stderr
(``dpwa run`` keeps it in ``<run_dir>/<node>.log``), writes ``<run_dir>/<node>.checkpoint.pt`` (model and
optimizer state, atomically) every ``--checkpoint-every`` steps and at the end, and reports the node's
held-out accuracy (``conn.report(accuracy=..., final_loss=...)``).

Real data: ``torchvision.datasets.CIFAR10(root, download=True)`` with the standard augmentation (random
crop with 4-pixel padding, horizontal flip, per-channel normalisation); nodes sharing a data root download
it once, under a file lock.  ``--synthetic``: random CIFAR-shaped images whose class shifts their mean
(so the loss can fall), generated from ``--seed``; torchvision is never imported.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from dpwa.adapters.pytorch import DpwaPyTorchAdapter
from dpwa.config import ClusterConfig, ConfigError, load_config
from dpwa.tools.demo import LINGER_MAX_S, configure_logging, linger_idle_s
from dpwa.utils.atomic import write_atomically

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the example's own modules, next to this file
from resnet import resnet18  # noqa: E402

log = logging.getLogger("pytorch-cifar")

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CHECKPOINT_SUFFIX = ".checkpoint.pt"
ENV_NODE, ENV_CONFIG, ENV_RUN_DIR, ENV_THREADS = "DPWA_NODE", "DPWA_CONFIG", "DPWA_RUN_DIR", "DPWA_TORCH_THREADS"


# --------------------------------------------------------------------------- data


def default_data_root() -> Path:
    """``$CIFAR_ROOT``, else ``$XDG_CACHE_HOME/dpwa/cifar10`` (``~/.cache/dpwa/cifar10``): outside the repository."""
    if os.environ.get("CIFAR_ROOT"):
        return Path(os.environ["CIFAR_ROOT"])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "dpwa" / "cifar10"


def shard(dataset: Dataset, index: int, count: int) -> Subset:
    """Samples ``index, index+count, ...`` of ``dataset``: disjoint shards covering it."""
    return Subset(dataset, range(index, len(dataset), count))  # type: ignore[arg-type]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if missing), so that nodes sharing a data root download once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def cifar10(root: Path) -> tuple[Dataset, Dataset]:
    """(train, test) CIFAR-10 from torchvision, downloaded into ``root`` if missing, standard augmentation."""
    try:  # only here: --synthetic must not need torchvision
        import torchvision
        from torchvision import transforms as T
    except ImportError as err:
        raise SystemExit(
            f"error: CIFAR-10 needs torchvision ({err}); install the build matching your torch, or use --synthetic"
        ) from err

    normalize = T.Normalize(CIFAR_MEAN, CIFAR_STD)
    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    test_tf = T.Compose([T.ToTensor(), normalize])
    with file_lock(root / ".download.lock"):
        train = torchvision.datasets.CIFAR10(str(root), train=True, download=True, transform=train_tf)
        test = torchvision.datasets.CIFAR10(str(root), train=False, download=True, transform=test_tf)
    return train, test


def synthetic(n_train: int, n_test: int, seed: int, classes: int = 10) -> tuple[Dataset, Dataset]:
    """Random CIFAR-shaped (3x32x32) images and labels: N(0, 1) noise plus half a class template."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, 3, 32, 32, generator=g)

    def split(n: int) -> TensorDataset:
        labels = torch.randint(0, classes, (n,), generator=g)
        images = torch.randn(n, 3, 32, 32, generator=g) + 0.5 * templates[labels]
        return TensorDataset(images, labels)

    return split(n_train), split(n_test)


def batches(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches, epoch after epoch, forever."""
    while True:
        yield from loader


# --------------------------------------------------------------------------- checkpoints


def checkpoint_path(run_dir: Path, node: str) -> Path:
    return run_dir / f"{node}{CHECKPOINT_SUFFIX}"


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, **extra: Any) -> None:
    """``torch.save`` model and optimizer state (plus ``extra``) to a temporary file, then rename it onto ``path``."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra}
    write_atomically(path, lambda handle: torch.save(state, handle))


# --------------------------------------------------------------------------- training


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) over ``loader``."""
    model.eval()
    correct, total, loss = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        total += len(y)
    model.train()
    return correct / max(1, total), loss / max(1, total)


def cosine_lr(peak: float, step: int, steps: int) -> float:
    """Cosine decay from ``peak`` at step 0 to 0 at ``steps``."""
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / steps))


def node_identity(args: argparse.Namespace) -> tuple[str, ClusterConfig, Path | None]:
    """(node name, cluster, run directory) from the flags, else from DPWA_NODE / DPWA_CONFIG / DPWA_RUN_DIR."""
    name = args.name or os.environ.get(ENV_NODE)
    config = args.config or os.environ.get(ENV_CONFIG)
    if not name or not config:
        raise SystemExit(
            "error: no node name or cluster file: start with `dpwa run CLUSTER.yaml train.py` "
            "or pass --name and --config"
        )
    run_dir = args.run_dir or os.environ.get(ENV_RUN_DIR)
    try:
        cluster = load_config(config)
        cluster.node(name)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from err
    return name, cluster, Path(run_dir) if run_dir else None


def run(args: argparse.Namespace) -> int:
    name, cluster, run_dir = node_identity(args)
    names = [n.name for n in cluster.nodes]
    index = names.index(cluster.node(name).name)
    if os.environ.get(ENV_THREADS):  # `dpwa run` gives each node its share of the cores
        torch.set_num_threads(int(os.environ[ENV_THREADS]))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    if args.synthetic:
        train_set, test_set = synthetic(args.synthetic_size, max(args.batch_size, args.synthetic_size // 8), args.seed)
    else:
        train_set, test_set = cifar10(args.data_root)
    node_set = shard(train_set, index, len(names))
    loader = DataLoader(
        node_set,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(args.seed * 1000 + index),
        persistent_workers=args.workers > 0,
        pin_memory=device.type == "cuda",
    )
    test_loader = DataLoader(test_set, batch_size=args.eval_batch_size, num_workers=args.workers)
    steps = args.steps or args.epochs * len(loader)

    torch.manual_seed(args.seed)  # the same initial weights on every node
    model = resnet18().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    start_step = 0
    ckpt = checkpoint_path(run_dir, name) if run_dir else None
    if args.resume and ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])  # copies into the existing tensors
        optimizer.load_state_dict(state["optimizer"])
        start_step = int(state["step"])
        log.info("node %s: resumed from %s at step %d", name, ckpt, start_step)
    log.info(
        "node %s: %s shard %d/%d (%d images), steps %d..%d of batch %d, lr %g cosine, device %s, %d thread(s)",
        name,
        "synthetic" if args.synthetic else "CIFAR-10",
        index + 1,
        len(names),
        len(node_set),
        start_step,
        steps,
        args.batch_size,
        args.lr,
        device,
        torch.get_num_threads(),
    )

    criterion = nn.CrossEntropyLoss()
    data = batches(loader)
    with DpwaPyTorchAdapter(model, name, cluster, seed=args.seed * 1000 + index, run_dir=run_dir) as conn:
        prev_loss, recent, factors, t0 = math.log(10), [], 0.0, time.monotonic()
        for step in range(start_step, steps):
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(args.lr, step, steps)
            conn.update_send(prev_loss)
            x, y = next(data)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            prev_loss = loss.item()
            factors += conn.update_wait(prev_loss)
            recent = (recent + [prev_loss])[-args.log_every :]
            done = step + 1
            if done % args.log_every == 0 or done == steps:
                elapsed = time.monotonic() - t0
                log.info(
                    "node %s: step %d/%d  loss %.4f  mean factor %.3f  %.1f images/s",
                    name,
                    done,
                    steps,
                    sum(recent) / len(recent),
                    factors / (done - start_step),
                    (done - start_step) * args.batch_size / elapsed,
                )
            if ckpt is not None and args.checkpoint_every and done % args.checkpoint_every == 0 and done != steps:
                save_checkpoint(ckpt, model, optimizer, step=done, node=name)
        seconds = time.monotonic() - t0
        accuracy, test_loss = evaluate(model, test_loader, device)
        final_loss = sum(recent) / len(recent) if recent else float("nan")
        log.info(
            "node %s: %d steps in %.1fs, held-out accuracy %.4f, test loss %.4f, final loss %.4f",
            name,
            steps - start_step,
            seconds,
            accuracy,
            test_loss,
            final_loss,
        )
        conn.report(accuracy=accuracy, final_loss=final_loss, test_loss=test_loss, steps=steps, seconds=seconds)
        if ckpt is not None:
            save_checkpoint(ckpt, model, optimizer, step=steps, node=name, accuracy=accuracy)
            log.info("node %s: checkpoint %s", name, ckpt)
        # Keep serving the final weights while peers still fetch them (they would otherwise time out on us).
        if len(names) > 1:
            idle = linger_idle_s(len(names) - 1, seconds, steps - start_step, conn.stats()["served"])
            conn.close(linger=LINGER_MAX_S, idle=idle)
    return 0


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--synthetic", action="store_true", help="generated CIFAR-shaped data; torchvision not needed")
    p.add_argument("--synthetic-size", type=int, default=2048, help="synthetic training images, all nodes together")
    p.add_argument("--steps", type=int, default=0, help="batches per node (0: --epochs over the node's shard)")
    p.add_argument("--epochs", type=int, default=30, help="passes over the node's shard when --steps is not given")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--eval-batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate, cosine decay to 0")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0, help="initial weights (equal on all nodes), batch order, data")
    p.add_argument(
        "--data-root",
        type=Path,
        default=default_data_root(),
        help="where CIFAR-10 is (downloaded if missing); $CIFAR_ROOT, else ~/.cache/dpwa/cifar10",
    )
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (0 = in the trainer)")
    p.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (0 = only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from <run_dir>/<node>.checkpoint.pt if it exists")
    p.add_argument("--log-every", type=int, default=20, help="steps between progress lines")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (else cuda if available)")
    p.add_argument("--name", help="this node's name (else $DPWA_NODE)")
    p.add_argument("--config", help="cluster file (else $DPWA_CONFIG)")
    p.add_argument("--run-dir", type=Path, help="run directory (else $DPWA_RUN_DIR)")
    args = p.parse_args(None if argv is None else list(argv))
    if args.steps < 0 or args.batch_size < 1 or args.log_every < 1:
        p.error("--steps must be >= 0, --batch-size and --log-every >= 1")
    return args


def main(argv: Iterable[str] | None = None) -> int:
    configure_logging()
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
