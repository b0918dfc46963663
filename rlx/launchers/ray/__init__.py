"""Ray Jobs: submit a recipe's head command to a Ray cluster that is already running (a
cluster `rlx launch --keep` holds, or any Ray cluster whose dashboard you can reach).

`render` builds the submission request (pure); `ops` sends it through Ray's Jobs API and
follows, stops and reports the job; `errors` turns the client's failures into one line.
"""

from __future__ import annotations

from rlx.launchers.spec import BackendSpec

BACKEND = BackendSpec(
    name="ray",
    title="Ray Jobs",
    suffix=".ray-job.json",
    renders=True,
    launch_options=frozenset({"address", "detach"}),
    stays_up="the cluster this job runs on stays up after it: it is not the job's (a cluster "
    "rlx launch --keep holds ends after its own resources.idle_minutes, or with rlx down)",
)
