"""A 100,000-GPU fleet in seconds, for the heatmap's browser test and `rackplane bench portal`."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

TEMPLATE = """
regions:
  - name: us-east
    racks: [{name: nvl-0000, kind: nvl72, block: spine-0}]
  - name: eu-west
    racks:
      - {name: hgx-0000, kind: hgx, gpu_model: H100-80GB, block: pod-0,
         node_template: {count: 10, name_prefix: h0000-}}
"""


def seed_big_fleet(session: Session, nvl72: int = 700, hgx: int = 620) -> None:
    """100,000 GPUs by default: `nvl72` NVL72 racks (18 trays of 4) in us-east, `hgx` HGX racks
    of ten 8-GPU nodes in eu-west. One rack of each goes through the fleet service; the rest
    are its copies, made by the database in seconds (the service's import of 100,000 GPUs
    takes half a minute, and the import is not what the heatmap's tests and bench measure).
    PostgreSQL only."""
    from app.fleet import document
    from app.fleet.service import apply_document

    apply_document(session, document.load(TEMPLATE))
    session.flush()
    session.execute(
        text(
            "CREATE TEMP TABLE rack_copy ON COMMIT DROP AS "
            "SELECT r.id AS src, gen_random_uuid() AS id, r.region_id, r.kind, "
            "left(r.name, 4) || lpad(g::text, 4, '0') AS name, "
            "split_part(r.block, '-', 1) || '-' || (g / 16)::text AS block "
            "FROM racks r, generate_series(1, CASE r.name WHEN 'nvl-0000' THEN :nvl "
            "ELSE :hgx END) g WHERE r.name IN ('nvl-0000', 'hgx-0000')"
        ),
        {"nvl": nvl72 - 1, "hgx": hgx - 1},
    )
    session.execute(
        text(
            "INSERT INTO racks (id, region_id, name, kind, block, created_at) "
            "SELECT id, region_id, name, kind, block, now() FROM rack_copy"
        )
    )
    session.execute(
        text(
            "CREATE TEMP TABLE node_copy ON COMMIT DROP AS "
            "SELECT n.id AS src, gen_random_uuid() AS id, c.id AS rack_id, "
            "c.name || '-' || n.name AS name, n.gpu_model, n.cpu_milli, n.memory_mib, "
            "n.state, n.nvlink_domain || '/' || c.name AS nvlink_domain "
            "FROM nodes n JOIN rack_copy c ON c.src = n.rack_id"
        )
    )
    session.execute(
        text(
            "INSERT INTO nodes (id, rack_id, name, gpu_model, cpu_milli, memory_mib, state, "
            "nvlink_domain, generation, created_at, health) "
            "SELECT id, rack_id, name, gpu_model, cpu_milli, memory_mib, state, "
            "nvlink_domain, 0, now(), 'healthy' FROM node_copy"
        )
    )
    session.execute(
        text(
            "INSERT INTO gpus (id, node_id, index, model, mig_mode, health, created_at, perf) "
            "SELECT gen_random_uuid(), c.id, g.index, g.model, g.mig_mode, g.health, now(), 1 "
            "FROM gpus g JOIN node_copy c ON c.src = g.node_id"
        )
    )
