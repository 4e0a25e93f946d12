"""Notebook parameter checks: a bad value is named with its rule; good values (numpy's too) pass."""

import numpy as np
import pytest

from moelab.params import check_bools, check_fractions, check_ints, check_real


def test_bad_parameters_are_named_with_their_rule():
    for bad in (-5, 2.0, True, "1024"):
        with pytest.raises(ValueError, match=rf"eval_tokens={bad!r}: must be an int >= 0 \(0: all\)"):
            check_ints(0, "0: all", eval_tokens=bad)
    with pytest.raises(ValueError, match=r"per_layer='no': must be True or False"):
        check_bools(interactive=False, per_layer="no")
    for bad in (0.2, [0.2, 1.0], [0.0], [True], ["0.1"], "0.1"):
        with pytest.raises(ValueError, match=r"targets=.*: must be a list of numbers in \(0, 1\)"):
            check_fractions(targets=bad)
    with pytest.raises(ValueError, match=r"targets=\[\]: .*not empty"):
        check_fractions(allow_empty=False, targets=[])
    for bad in (-0.1, float("nan"), float("inf"), "0.5"):
        with pytest.raises(ValueError, match=r"budget=.*: must be a number in \[0.0, inf\]"):
            check_real("budget", bad, 0.0)
    for lo, bad in ((0, -1), (3, 2)):  # one below lo
        with pytest.raises(ValueError, match=rf"x={bad}: must be an int >= {lo}"):
            check_ints(lo, x=bad)
    with pytest.raises(ValueError, match=r"t=1.5: must be a number in \[0, 1\]"):
        check_real("t", 1.5, 0, 1)
    check_ints(1, tokens=np.int64(8), seq_len=256)
    check_ints(3, x=3)
    check_real("t", 1, 0, 1)
    check_bools(a=True, b=False)
    check_fractions(targets=[0.1, np.float32(0.25)])
    check_fractions(targets=[])
    check_real("budget", np.float64(0.005), 0.0)
