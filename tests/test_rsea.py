"""RSEA (FedAMoLE Sec. IV-D): every solution satisfies Definition IV.1's constraints, SCIP and
HiGHS reach the same optimum, the softmax runs over clients, infeasible settings fail early."""
import itertools

import pytest
import torch

from comix.algorithms.rsea import (assign, check_feasible, random_assignment, relevance, selection_probs,
                                   solve_assignment)

CASES = [(10, 30, 2, 2, 8), (4, 6, 2, 2, 4), (5, 7, 3, 2, 6), (3, 3, 1, 1, 1)]  # N, E, k_c, k_e, b


def _constraints_hold(d, k_c, k_e, b):
    return bool((d.sum(0) == k_c).all() and (d.sum(1) >= k_e).all() and (d.sum(1) <= b).all())


@pytest.mark.parametrize("n,e,k_c,k_e,b", CASES)
@pytest.mark.parametrize("solver", ["scip", "highs"])
def test_every_solution_satisfies_the_constraints(n, e, k_c, k_e, b, solver):
    gen = torch.Generator().manual_seed(n * e)
    for _ in range(3):
        p = selection_probs(torch.randn(n, e, generator=gen, dtype=torch.float64) * 3)
        d = solve_assignment(p, k_c, k_e, b, solver)
        assert d.dtype == torch.bool and d.shape == (n, e) and _constraints_hold(d, k_c, k_e, b)
    assert _constraints_hold(random_assignment(n, e, k_c, k_e, b, gen, solver), k_c, k_e, b)


@pytest.mark.parametrize("seed", range(6))
def test_scip_and_highs_reach_the_same_optimum(seed):
    gen = torch.Generator().manual_seed(seed)
    p = selection_probs(torch.randn(6, 9, generator=gen, dtype=torch.float64) * 2)
    values = [float((p * solve_assignment(p, 2, 2, 4, s)).sum()) for s in ("scip", "highs")]
    assert values[0] == pytest.approx(values[1], abs=1e-9)


def test_the_optimum_beats_every_feasible_assignment_on_a_small_instance():
    gen = torch.Generator().manual_seed(1)
    n, e, k_c, k_e, b = 3, 3, 2, 1, 3
    p = selection_probs(torch.randn(n, e, generator=gen, dtype=torch.float64))
    best = float((p * solve_assignment(p, k_c, k_e, b)).sum())
    columns = list(itertools.combinations(range(n), k_c))
    brute = -1.0
    for choice in itertools.product(columns, repeat=e):
        d = torch.zeros(n, e, dtype=torch.bool)
        for j, rows in enumerate(choice):
            d[list(rows), j] = True
        if _constraints_hold(d, k_c, k_e, b):
            brute = max(brute, float((p * d).sum()))
    assert best == pytest.approx(brute)


def test_relevance_softmax_is_over_clients():
    client = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    expert = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    s = relevance(client, expert, d=4)
    assert torch.allclose(s, torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64))
    p = selection_probs(s)
    assert torch.allclose(p.sum(0), torch.ones(2, dtype=torch.float64))      # a distribution per expert
    assert not torch.allclose(p.sum(1), torch.ones(3, dtype=torch.float64))
    d, info = assign(client, expert, 4, k_c=2, k_e=1, b=2)
    assert d[:, 0].tolist() == [True, False, True] and d[:, 1].tolist() == [False, True, True]
    assert info["objective"] == pytest.approx(float((p * d).sum())) and info["solve_s"] >= 0


@pytest.mark.parametrize("n,e,k_c,k_e,b,needle", [
    (10, 5, 2, 2, 8, "E * k_c = 5 * 2 = 10 picks must lie in [N * k_e, N * b] = [20, 80]"),
    (3, 30, 2, 2, 8, "E * k_c = 30 * 2 = 60 picks must lie in [N * k_e, N * b] = [6, 24]"),
    (2, 30, 3, 2, 8, "k_c = 3 clients, but there are 2"),
    (10, 30, 2, 9, 8, "k_e = 9 experts per client exceeds the bound b = 8"),
])
def test_impossible_assignments_fail_with_one_line_naming_the_numbers(n, e, k_c, k_e, b, needle):
    with pytest.raises(ValueError, match=needle.replace("*", r"\*").replace("[", r"\[").replace("]", r"\]")):
        check_feasible(e, n, k_c, k_e, b)
