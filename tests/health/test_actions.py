"""The action table, row by row, against what the sources say (written out here on their own,
not read from the table): NVIDIA's Xid catalog's immediate action per code, mapped to ours."""

from __future__ import annotations

import pytest

from app.health import actions
from app.health.actions import Action, Repair, Scope

pytestmark = pytest.mark.no_db

A = Action
# The catalog's bucket per code, for every code it lists for A100/H100/B100/GB200 with an
# immediate action other than IGNORE (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog).
CATALOG = {
    **dict.fromkeys(
        [
            8,
            11,
            13,
            25,
            31,
            32,
            39,
            40,
            41,
            60,
            68,
            69,
            70,
            71,
            72,
            75,
            76,
            77,
            80,
            82,
            83,
            84,
            85,
            86,
            88,
            89,
            94,
            *range(96, 106),
            *range(126, 136),
            139,
        ],
        "RESTART_APP",
    ),  # fmt: skip
    45: "WORKFLOW_XID_45",
    46: "RESET_GPU",
    48: "WORKFLOW_XID_48",
    54: "CHECK_MECHANICALS",
    62: "RESET_GPU",
    64: "RESET_GPU",  # investigatory: CONTACT_SUPPORT
    74: "WORKFLOW_NVLINK_ERR",
    78: "UPDATE_SWFW",
    79: "RESTART_BM",
    95: "RESET_GPU",
    109: "RESET_GPU",
    110: "RESET_GPU",
    119: "RESET_GPU",
    120: "RESET_GPU",
    136: "RESET_GPU",
    140: "RESET_GPU",
    142: "CONTACT_SUPPORT",
    143: "RESET_GPU",
    **dict.fromkeys(range(144, 151), "WORKFLOW_NVLINK5_ERR"),
    151: "RESTART_VM",
    154: "XID_154",
    155: "RESET_GPU",
    156: "RESET_GPU",
    158: "RESET_GPU",
    159: "CHECK_UVM",
}
# Our action for each bucket; the exceptions below say why they differ.
BUCKET = {
    "RESTART_APP": A.none,
    "WORKFLOW_XID_45": A.none,
    "RESTART_VM": A.none,
    "CHECK_UVM": A.none,
    "RESET_GPU": A.reset_gpu,
    "WORKFLOW_XID_48": A.reset_gpu,
    "RESTART_BM": A.reboot_node,
    "WORKFLOW_NVLINK_ERR": A.drain_nvlink_domain,
    "WORKFLOW_NVLINK5_ERR": A.drain_nvlink_domain,
    "CHECK_MECHANICALS": A.service,
    "CONTACT_SUPPORT": A.service,
    "UPDATE_SWFW": A.watch,
    "XID_154": A.watch,  # the recovery action field says what to do
}
EXCEPTIONS = {
    94: A.watch,  # RESTART_APP, but "reset the GPU when convenient" and DCGM fails it
    64: A.service,  # a failed row remap: no reset undoes it (reference; DCGM MEM)
}


@pytest.mark.parametrize("code", sorted(CATALOG))
def test_every_catalog_code_has_its_row(code):
    rule = actions.XID_RULES[code]
    assert rule.code == code and rule.signal == "xid"
    assert rule.action is EXCEPTIONS.get(code, BUCKET[CATALOG[code]])
    assert rule.source and rule.what


@pytest.mark.parametrize("code", sorted(actions.XID_RULES))
def test_every_row_cites_a_source_and_says_what_it_means(code):
    rule = actions.XID_RULES[code]
    assert any(tag in rule.source for tag in ("[CAT]", "[DCGM]", "[REF]", "[NVS]", "[HV]"))
    assert rule.fatal == (actions.EFFECT[rule.action][0] is not Scope.none)


def test_rows_beyond_the_catalog_are_the_watched_ignore_codes():
    assert set(actions.XID_RULES) - set(CATALOG) == {43, 63, 92}
    assert actions.XID_RULES[43].action is A.none  # the application's channel reset
    assert actions.XID_RULES[63].action is A.watch  # a remap pending the next reset
    assert actions.XID_RULES[92].action is A.watch  # high single-bit ECC rate


def test_an_unknown_xid_is_watched_never_ignored_nor_drained():
    rule = actions.rule_for_xid(999)
    assert rule.action is A.watch and rule.source == "unknown" and "999" in rule.what


@pytest.mark.parametrize(
    ("value", "action"),
    [(1, A.reset_gpu), (2, A.reboot_node), (3, A.drain_nvlink_domain), (4, A.reset_gpu),
     (5, A.drain_nvlink_domain), (6, A.reset_gpu), (7, A.reboot_node), (42, A.watch)],
)  # fmt: skip
def test_the_drivers_recovery_action(value, action):
    assert actions.rule_for_recovery(value).action is action


def test_recovery_action_none_asks_nothing():
    assert actions.rule_for_recovery(0) is None


@pytest.mark.parametrize(
    ("signal", "action", "threshold"),
    [
        ("ecc_dbe", A.reset_gpu, 1),
        ("row_remap_failure", A.service, 1),
        ("uncorrectable_remapped_rows", A.reset_gpu, 1),
        ("retired_dbe", A.watch, 1),
        ("nvlink_crc_flit", A.watch, 100),
        ("nvlink_replay", A.watch, 10),
        ("nvlink_recovery", A.watch, 1),
        ("pcie_replay", A.watch, 8),
        ("hw_slowdown", A.watch, 0.5),
        ("heartbeat_lost", A.reboot_node, 1),
    ],
)
def test_every_other_signal(signal, action, threshold):
    rule = actions.SIGNALS[signal]
    assert (rule.action, rule.threshold) == (action, threshold)
    assert rule.source


def test_an_incident_is_classified_by_its_worst_row_and_does_the_union_of_its_rows():
    app_err, ecc, bus, nvlink = (actions.rule_for_xid(c) for c in (13, 48, 79, 74))
    assert actions.worst([app_err, ecc, app_err]) is ecc
    assert actions.worst([app_err, bus, ecc]) is bus
    # A reboot and an NVLink drain: the domain's work stops and the node reboots.
    assert actions.effect([bus, nvlink]) == (Scope.domain, Repair.reboot)
    assert actions.effect([app_err]) == (Scope.none, Repair.none)
    assert actions.effect([ecc, actions.rule_for_xid(64)]) == (Scope.gpu, Repair.service)


def test_ranks_run_from_mildest_to_worst():
    order = [A.none, A.watch, A.reset_gpu, A.reboot_node, A.drain_nvlink_domain, A.service]
    assert [a.rank for a in order] == sorted(a.rank for a in order)
