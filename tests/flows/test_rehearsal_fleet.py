"""The pipeline's rehearsal fleet directory (``runs/<recipe>/fleet``) when the recipe's registered model changes
between runs: a stopped fleet of the old model is history and the new one starts there; a fleet of the old model
with a process still recorded is refused, as `deploy` refuses to mix two models in one fleet."""

from __future__ import annotations

import pytest

from flows.recipe import RolloutSection
from flows.rollout import rehearsal_fleet
from serving.fleet.errors import FleetError
from serving.fleet.record import FleetRecord, read_record, write_record


def test_a_stopped_rehearsal_fleet_of_another_model_is_replaced(tmp_path):
    write_record(tmp_path, FleetRecord("tiny-default", "file:/nowhere"))
    fleet = rehearsal_fleet(RolloutSection(), str(tmp_path), "tiny-lane-base", "file:/nowhere")
    fleet.save()
    assert read_record(tmp_path).model_name == "tiny-lane-base"


def test_a_rehearsal_fleet_of_another_model_with_a_live_gateway_is_refused(tmp_path):
    write_record(tmp_path, FleetRecord("tiny-default", "file:/nowhere", gateway_pid=12345))
    with pytest.raises(FleetError, match="this fleet serves 'tiny-default', not 'tiny-lane-base'"):
        rehearsal_fleet(RolloutSection(), str(tmp_path), "tiny-lane-base", "file:/nowhere")
    assert read_record(tmp_path).model_name == "tiny-default"
