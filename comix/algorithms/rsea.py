"""Reverse selection-based expert assignment (FedAMoLE, journal version Sec. IV-D): the server's
solve that decides, per AMoLE module, which clients each domain expert goes to next round.

  relevance  s_ij = h_t_i . h_e_j / sqrt(d)        client i's mean token embedding (eq. 23) and
                                                   expert j's mean expert embedding (eq. 24-26);
                                                   d is the AMoLE layer's own score scale (eq. 10:
                                                   sqrt(d) in the paper, sqrt(r) in the authors'
                                                   node.py dispatch_experts and layer.py alike)
  selection  P_ij = softmax_i(s_ij)                over *clients*: expert j's preference (eq. 28)
  assignment max_D <P, D>  s.t.  sum_i D_ij = k_c  (every expert picks exactly k_c clients)
                                 k_e <= sum_j D_ij <= b   (every client gets k_e..b experts)
                                 D binary                 (Definition IV.1)

The problem is a degree-constrained bipartite assignment, solved as a MILP with SCIP
(``pyscipopt``, as the paper says) or HiGHS (``scipy.optimize.milp``); both reach the same
optimum value (tests/test_rsea.py compares them on random instances). Round 0 and the
``fedamole-r`` ablation use ``random_assignment``: the same solve on random preferences, so a
random assignment satisfies exactly the same constraints.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch


def check_feasible(n_experts: int, n_clients: int, k_c: int, k_e: int, b: int) -> None:
    """One line naming the numbers when no assignment can exist: E experts each pick k_c of N
    clients (E * k_c picks) and each client needs between k_e and b of them."""
    if not 1 <= k_c <= n_clients:
        raise ValueError(f"fedamole: each expert picks k_c = {k_c} clients, but there are {n_clients}")
    if k_e > b:
        raise ValueError(f"fedamole: k_e = {k_e} experts per client exceeds the bound b = {b}")
    picks = n_experts * k_c
    if not n_clients * k_e <= picks <= n_clients * b:
        raise ValueError(f"fedamole: infeasible assignment: E * k_c = {n_experts} * {k_c} = {picks} picks must lie "
                         f"in [N * k_e, N * b] = [{n_clients * k_e}, {n_clients * b}] for N = {n_clients} clients")


def relevance(client_emb: torch.Tensor, expert_emb: torch.Tensor, d: int) -> torch.Tensor:
    """s (clients x experts) = client_emb @ expert_emb^T / sqrt(d)  (eq. 26)."""
    return client_emb.double() @ expert_emb.double().t() / math.sqrt(d)


def selection_probs(s: torch.Tensor) -> torch.Tensor:
    """P_ij = softmax over clients i of s_ij (eq. 28): each expert's distribution over clients."""
    return torch.softmax(s, dim=0)


def _solve_scip(p: np.ndarray, k_c: int, k_e: int, b: int) -> np.ndarray:
    from pyscipopt import Model, quicksum

    n, e = p.shape
    m = Model("rsea")
    m.hideOutput()
    d = {(i, j): m.addVar(vtype="B", name=f"d_{i}_{j}") for i in range(n) for j in range(e)}
    for j in range(e):
        m.addCons(quicksum(d[i, j] for i in range(n)) == k_c)
    for i in range(n):
        row = quicksum(d[i, j] for j in range(e))
        m.addCons(row >= k_e)
        m.addCons(row <= b)
    m.setObjective(quicksum(float(p[i, j]) * d[i, j] for i in range(n) for j in range(e)), "maximize")
    m.optimize()
    if m.getStatus() != "optimal":
        raise RuntimeError(f"SCIP ended with status {m.getStatus()}")
    return np.array([[m.getVal(d[i, j]) > 0.5 for j in range(e)] for i in range(n)])


def _solve_highs(p: np.ndarray, k_c: int, k_e: int, b: int) -> np.ndarray:
    from scipy.optimize import Bounds, LinearConstraint, milp

    n, e = p.shape
    cols = np.zeros((e, n * e))     # variable (i, j) at index i * e + j
    rows = np.zeros((n, n * e))
    for i in range(n):
        rows[i, i * e:(i + 1) * e] = 1
        for j in range(e):
            cols[j, i * e + j] = 1
    res = milp(-p.reshape(-1), integrality=np.ones(n * e), bounds=Bounds(0, 1),
               constraints=[LinearConstraint(cols, k_c, k_c), LinearConstraint(rows, k_e, b)])
    if not res.success:
        raise RuntimeError(f"HiGHS: {res.message}")
    return res.x.reshape(n, e) > 0.5


SOLVERS = {"scip": _solve_scip, "highs": _solve_highs}


def solve_assignment(p: torch.Tensor, k_c: int, k_e: int, b: int, solver: str = "scip") -> torch.Tensor:
    """The optimal D (clients x experts, bool) of Definition IV.1 for preferences ``p``."""
    n, e = p.shape
    check_feasible(e, n, k_c, k_e, b)
    if solver not in SOLVERS:
        raise ValueError(f"fedamole.solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    d = torch.from_numpy(SOLVERS[solver](p.double().numpy(), k_c, k_e, b))
    assert (d.sum(0) == k_c).all() and (d.sum(1) >= k_e).all() and (d.sum(1) <= b).all()
    return d


def random_assignment(n_clients: int, n_experts: int, k_c: int, k_e: int, b: int, gen: torch.Generator,
                      solver: str = "scip") -> torch.Tensor:
    """A random D under the same constraints (round 0, and the fedamole-r ablation)."""
    return solve_assignment(torch.rand(n_clients, n_experts, generator=gen, dtype=torch.float64), k_c, k_e, b, solver)


def assign(client_emb: torch.Tensor, expert_emb: torch.Tensor, scale_dim: int, k_c: int, k_e: int, b: int,
           solver: str = "scip") -> tuple[torch.Tensor, dict]:
    """One module's RSEA: relevance (eq. 26, divided by sqrt(``scale_dim``): the layer's own score
    scale) -> selection probabilities -> MILP; returns D and what the reports show."""
    return assign_by_relevance(relevance(client_emb, expert_emb, scale_dim), k_c, k_e, b, solver)


def assign_by_relevance(s: torch.Tensor, k_c: int, k_e: int, b: int, solver: str = "scip") -> tuple[torch.Tensor, dict]:
    """Selection probabilities (eq. 28) and the MILP from a relevance matrix s (clients x
    experts); returns D and the relevance, probabilities, objective and solve time."""
    t0 = time.perf_counter()
    p = selection_probs(s)
    d = solve_assignment(p, k_c, k_e, b, solver)
    return d, {"relevance": s, "probs": p, "objective": float((p * d).sum()), "solve_s": time.perf_counter() - t0}
