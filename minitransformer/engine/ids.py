"""Integer ids (token ids, target classes) checked against a vocabulary before an op indexes
with them: NumPy would wrap a negative id around, and a GPU would read out of bounds."""


def check_ids(ids, V, what, hint=""):
    """Raise a ValueError naming the first id of ``ids`` outside [0, V) (what: 'target id',
    'token id'). It reads ids.min() and ids.max(): on a GPU array that waits for the device,
    so callers run it on the host copy where there is one."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= V):
        bad = int(ids[(ids < 0) | (ids >= V)].ravel()[0])
        raise ValueError(f"{what} {bad} is outside the vocabulary [0, {V}){hint}")
