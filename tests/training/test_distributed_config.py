"""The `distributed:` key: values a stage cannot train with are refused with the key's name, before any work."""

from __future__ import annotations

import pytest
import yaml

from artifacts.errors import ConfigError
from flows.recipe import load_recipe
from training.distributed_config import DistributedSettings
from training.draft_config import DraftConfig, DraftError
from training.launcher import check_devices
from training.stage_config import GRPOStageConfig, SFTStageConfig, TrainingError


@pytest.mark.parametrize("values,message", [
    ({"num_processes": 0}, "num_processes: must be an integer >= 1, got 0"),
    ({"num_processes": 2, "strategy": "zero3"}, "strategy: must be one of ddp, fsdp, got 'zero3'"),
])
def test_settings_refuse_what_cannot_run(values, message):
    with pytest.raises(ValueError, match=message):
        DistributedSettings(**values)


def test_the_recipe_batch_is_the_global_batch_and_must_split_evenly():
    assert SFTStageConfig(batch_size=8, distributed={"num_processes": 2}).distributed.per_process(8) == 4
    with pytest.raises(ValueError, match="distributed.num_processes: batch_size 8 does not split evenly over 3"):
        SFTStageConfig(batch_size=8, distributed={"num_processes": 3})


def test_each_grpo_process_samples_whole_groups():
    GRPOStageConfig(batch_size=16, num_generations=8, distributed={"num_processes": 2})
    with pytest.raises(ValueError, match=r"each of 4 processes gets 4 of batch_size 16 completions, not a multiple "
                                         r"of num_generations \(8\)"):
        GRPOStageConfig(batch_size=16, num_generations=8, distributed={"num_processes": 4})


def test_the_process_count_is_not_part_of_what_a_stage_trains():
    one, two = SFTStageConfig(), SFTStageConfig(distributed={"num_processes": 2})
    assert one.recipe() == two.recipe() and "distributed" not in one.recipe()
    assert DraftConfig().recipe() == DraftConfig(distributed={"num_processes": 2}).recipe()


def test_the_draft_trains_under_ddp_only():
    with pytest.raises(DraftError, match="distributed.strategy: the draft trains under ddp only"):
        DraftConfig(distributed={"num_processes": 2, "strategy": "fsdp"})


def test_fsdp_on_cpu_and_more_processes_than_gpus_are_refused():
    with pytest.raises(TrainingError, match="distributed.strategy: fsdp needs one GPU per process"):
        check_devices(DistributedSettings(num_processes=2, strategy="fsdp"), "cpu")
    check_devices(DistributedSettings(num_processes=2), "cpu")
    import torch

    with pytest.raises(TrainingError, match=f"distributed.num_processes: 99 processes need as many GPUs .* has "
                                            f"{torch.cuda.device_count()}"):
        check_devices(DistributedSettings(num_processes=99), "cuda")


@pytest.mark.parametrize("section,message", [
    ({"sft": {"distributed": {"num_processes": 0}}}, "training.sft.distributed: num_processes: must be"),
    ({"dpo": {"distributed": {"num_processes": 2, "strategy": "zero3"}}}, "training.dpo.distributed: strategy:"),
    ({"grpo": {"distributed": {"num_processes": 3}}}, "training.grpo: distributed.num_processes: batch_size 16"),
    ({"sft": {"distributed": {"num_proc": 2}}}, "unknown key 'training.sft.distributed.num_proc'"),
])
def test_a_bad_distributed_key_in_a_recipe_is_one_line_naming_it(tmp_path, section, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"training": section}))
    with pytest.raises(ConfigError, match=message) as caught:
        load_recipe(path)
    assert str(caught.value).startswith(str(path)) and "\n" not in str(caught.value)


def test_a_bad_draft_distributed_key_names_it(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"draft": {"batch_size": 16, "distributed": {"num_processes": 3}}}))
    with pytest.raises(ConfigError, match="draft: distributed.num_processes: batch_size 16 does not split"):
        load_recipe(path)
