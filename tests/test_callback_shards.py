"""The Lightning and Hugging Face callbacks put this node's shard in place (adapters/sampler.py): run for real, one
node after the other, in this process, each node of a 2-node cluster sees a disjoint half of the data set and the
two halves cover it; a loader that already has a DistributedSampler is refused with a message. Skipped where the
extra is not installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import free_ports
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from dpwa.modelfile import read_model

pytestmark = [pytest.mark.slow, pytest.mark.integration]  # real Lightning and Trainer fits: ~13 s in all

N_ITEMS = 48
BATCH = 8


@pytest.fixture(autouse=True)
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("DPWA_", "SLURM_")) or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    """Two nodes; each trains alone (its peer is never up), so a fetch gives up after timeout_ms."""
    ports = free_ports(2)  # held until the test ends (a reservation given back at once left them to others)
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "timeout_ms: 100\nnodes:\n"
        + "".join(f"  - {{name: w{i + 1}, host: 127.0.0.1, port: {port}}}\n" for i, port in enumerate(ports))
    )
    return path


def indexed_data() -> TensorDataset:
    """Item i's feature is i: a training step sees which items its batch holds."""
    return TensorDataset(torch.arange(N_ITEMS, dtype=torch.float32).unsqueeze(1), torch.zeros(N_ITEMS, 1))


def assert_disjoint_halves(seen: dict[str, list[int]]) -> None:
    w1, w2 = (sorted(seen[name]) for name in ("w1", "w2"))
    assert len(w1) == len(set(w1)) == N_ITEMS // 2 and len(w2) == len(set(w2)) == N_ITEMS // 2, seen  # one epoch
    assert set(w1).isdisjoint(w2) and sorted(w1 + w2) == list(range(N_ITEMS)), seen


def test_lightning_nodes_train_on_disjoint_shards_covering_the_data(cluster: Path, tmp_path: Path) -> None:
    lightning = pytest.importorskip("lightning")
    from dpwa.adapters.lightning import DpwaCallback

    class Recording(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(1, 1)
            self.seen: list[int] = []

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.seen += [int(v) for v in x.flatten()]
            return nn.functional.mse_loss(self.net(x * 0.0), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(name: str, loader: DataLoader) -> Recording:
        module = Recording()
        gossip = DpwaCallback(name, str(cluster), linger=0.0, run_dir=tmp_path / "run")
        trainer = lightning.Trainer(
            max_epochs=1, callbacks=[gossip], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=str(tmp_path), accelerator="cpu", devices=1,
        )  # fmt: skip
        trainer.fit(module, loader)
        return module

    modules = {name: fit(name, DataLoader(indexed_data(), batch_size=BATCH, shuffle=True)) for name in ("w1", "w2")}
    assert_disjoint_halves({name: module.seen for name, module in modules.items()})
    assert_saved(tmp_path / "run", {name: module.net for name, module in modules.items()})
    theirs = DataLoader(indexed_data(), batch_size=BATCH, sampler=DistributedSampler(indexed_data(), 2, 0))
    with pytest.raises(ValueError, match="DpwaCallback: the training data loader already has a DistributedSampler"):
        fit("w1", theirs)
    batches = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(indexed_data()), BATCH, drop_last=False)
    with pytest.raises(ValueError, match="DpwaCallback: the training data loader has a batch_sampler of its own"):
        fit("w1", DataLoader(indexed_data(), batch_sampler=batches))


def assert_saved(run_dir: Path, nets: dict[str, nn.Module]) -> None:
    """Each node saved its final model for `dpwa average` when it closed (its ``net.`` entries are the module's)."""
    for name, net in nets.items():
        saved = read_model(run_dir / f"{name}.model.npz")
        assert all(torch.equal(torch.from_numpy(saved.arrays[f"net.{k}"]), v) for k, v in net.state_dict().items())


class Items(Dataset):
    """Item i is ``{"x": [i], "labels": [0]}``, as a Trainer model takes it."""

    def __len__(self) -> int:
        return N_ITEMS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([float(i)]), "labels": torch.zeros(1)}


def test_hugging_face_nodes_train_on_disjoint_shards_covering_the_data(cluster: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from dpwa.adapters.huggingface import DpwaTrainerCallback

    class Recording(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(1, 1)
            self.seen: list[int] = []

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            self.seen += [int(v) for v in x.flatten()]
            return {"loss": nn.functional.mse_loss(self.net(x * 0.0), labels)}

    def train(name: str, add_later: bool = False) -> Recording:
        model = Recording()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), num_train_epochs=1, per_device_train_batch_size=BATCH, optim="sgd",
            report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
            dataloader_num_workers=0, logging_steps=1,
        )  # fmt: skip
        gossip = DpwaTrainerCallback(name, str(cluster), linger=0.0, run_dir=tmp_path / "run")
        callbacks = [] if add_later else [gossip]
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Items(), callbacks=callbacks)
        if add_later:
            trainer.add_callback(gossip)
        trainer.train()
        return model

    models = {name: train(name) for name in ("w1", "w2")}
    assert_disjoint_halves({name: model.seen for name, model in models.items()})
    assert_saved(tmp_path / "run", {name: model.net for name, model in models.items()})
    with pytest.raises(ValueError, match="DpwaTrainerCallback: the training data are not split between the nodes"):
        train("w1", add_later=True)
