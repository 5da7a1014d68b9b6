"""Progress bars watched: :class:`Recorded`, daskdag's sweep bar recording its count at every
update (monkeypatched over ``daskdag.sweeps.progress.tqdm``)."""

from daskdag.sweeps import progress


class Recorded(progress.tqdm):
    """The bar, recording its count at every update."""

    counts: list = []

    def update(self, n=1):
        out = super().update(n)
        Recorded.counts.append(self.n)
        return out
