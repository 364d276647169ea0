"""Path selection and the host side of every path: which module function serves a problem, the
tables it reads, and the call. ``select.ORDER`` lists the paths of each mode; ``dispatch`` runs a
checked call through them."""

from .base import Problem
from .capabilities import Capabilities
from .dispatch import (Loaded, batch_route, group_route, paged_problem, prepare_batch, problem_route, run_batch,
                       run_group, run_paged)
from .select import ORDER, NoPath, Route, select

__all__ = ["Problem", "Capabilities", "Loaded", "Route", "NoPath", "ORDER", "select", "batch_route", "group_route",
           "problem_route", "paged_problem", "prepare_batch", "run_batch", "run_group", "run_paged"]
