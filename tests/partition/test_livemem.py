"""kiln_bench.livemem: the measured peak of live storage bytes created during a call."""
import torch

from kiln_bench.livemem import measure_peak

N = 256
B = N * N * 4  # one fp32 (N x N) tensor


def test_known_peak_of_an_eager_step():
    x = torch.randn(N, N)

    def step():
        a = x * 2             # 1 block
        v = a.view(-1)[:10]   # a view: no new storage
        a.add_(1)             # in place: no new storage
        b = a + v.sum()       # 2 blocks live (plus a 4-byte scalar that dies)
        del a, v
        c = b.exp()           # b and c: 2 blocks
        del b
        return c.sum()        # c and the scalar result

    r = measure_peak(step)
    assert r.peak == 2 * B + 4
    assert r.end == 0  # everything it made died (the result is dropped after the call)


def test_storages_alive_before_are_not_counted():
    w = torch.randn(N, N, requires_grad=True)
    old = torch.randn(N, N)

    def step():
        old.mul_(2)              # writes a pre-existing storage
        y = old + 0              # new: 1 block (autograd saves it for the mul)
        loss = (y * w).sum()     # y * w: 1 block, dies after the sum; loss: 4 bytes
        loss.backward()          # ones_like (4 B), then w.grad = ones * y: a block that outlives the step
        return None

    r = measure_peak(step)
    assert r.end == B            # w.grad
    assert r.peak == 2 * B + 8   # y + w.grad + loss + the backward's seed


def test_autograd_backward_and_freed_memory():
    x = torch.randn(N, N, requires_grad=True)

    def step():
        h = [x]
        for _ in range(4):
            h.append(h[-1].cos())   # eager autograd saves each cos input
        h[-1].sum().backward()

    eager = measure_peak(step)
    assert eager.peak >= 4 * B      # the four activations are alive at the start of the backward
    x.grad = None

    def step_nograd():
        with torch.no_grad():
            h = x
            for _ in range(4):
                h = h.cos()         # each result frees the previous one
    assert measure_peak(step_nograd).peak == 2 * B
