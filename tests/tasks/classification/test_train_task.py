"""The classification task's own refusals, through its public class."""
import pytest
import torch

from polaformer.data.folder import DatasetError
from polaformer.tasks.classification import load_config
from polaformer.tasks.classification.train import ClassificationTask


def test_a_first_batch_without_a_readable_image_is_a_data_error():
    """No earlier batch can stand in for it (later empty batches reuse the previous one)."""
    cfg = load_config(None, ["DATA.DATA_PATH", "/data/pets"])
    task = ClassificationTask(cfg, cfg)
    empty = (torch.empty(0, 3, 32, 32), torch.empty(0, dtype=torch.long), 4)
    with pytest.raises(DatasetError, match=r"first training batch of this run has no readable image \(4 skipped\): "
                                           r"too many unreadable images in /data/pets"):
        task.step(torch.nn.Identity(), empty, torch.device("cpu"))
