"""Every supported torch.distributed call on podsim, checked against values computed here
(an independent reference: each rank knows what every rank contributed). Prints `api ok`.
`podsim run --topology 2x2x2 -- python api.py`"""

import torch
import torch.distributed as dist

import common

dist.init_process_group(common.backend())
rank, n = dist.get_rank(), dist.get_world_size()
ranks = torch.arange(n, dtype=torch.float64)


def check(what, got, want):
    if not torch.equal(got, want.to(got.dtype)):
        raise AssertionError(f"rank {rank}: {what}: got {got.tolist()}, want {want.tolist()}")


# all_reduce, every op on every dtype (values small enough to be exact in each dtype).
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64):
    for op, want in (
        (dist.ReduceOp.SUM, ranks.sum() + 1 * n),
        (dist.ReduceOp.MAX, ranks.max() + 1),
        (dist.ReduceOp.MIN, ranks.min() + 1),
        (dist.ReduceOp.PRODUCT, (ranks % 2 + 1).prod()),
    ):
        x = torch.tensor([rank % 2 + 1 if op == dist.ReduceOp.PRODUCT else rank + 1] * 3, dtype=dtype)
        dist.all_reduce(x, op=op)
        check(f"all_reduce {op} {dtype}", x, want.repeat(3))
x = torch.full((4,), float(rank))
dist.all_reduce(x, op=dist.ReduceOp.AVG)
check("all_reduce avg", x, torch.full((4,), ranks.mean().item()))

# all_gather (list and into one tensor), int64 values beyond float32's exact range.
big = torch.tensor([2**40 + rank, -rank], dtype=torch.int64)
outs = [torch.empty_like(big) for _ in range(n)]
dist.all_gather(outs, big)
check("all_gather int64", torch.stack(outs), torch.tensor([[2**40 + r, -r] for r in range(n)]))
into = torch.empty(n * 2, dtype=torch.bfloat16)
dist.all_gather_into_tensor(into, torch.tensor([rank, 0.5], dtype=torch.bfloat16))
check("all_gather_into_tensor", into, torch.tensor([[r, 0.5] for r in range(n)]).reshape(-1))

# reduce_scatter_tensor, broadcast, barrier.
rs = torch.empty(2)
dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n) + rank)
check("reduce_scatter_tensor", rs, torch.arange(2.0 * n)[2 * rank : 2 * rank + 2] * n + ranks.sum())
b = torch.tensor([rank, -1], dtype=torch.int32)
dist.broadcast(b, src=n - 1)
check("broadcast int32", b, torch.tensor([n - 1, -1]))
dist.barrier()

# all_to_all_single, even then uneven splits (rank r sends j + 1 rows to rank j).
even = torch.empty(n)
dist.all_to_all_single(even, torch.arange(n, dtype=torch.float32) + 100 * rank)
check("all_to_all_single", even, torch.tensor([100.0 * j + rank for j in range(n)]))
send = torch.cat([torch.full((j + 1,), float(rank)) for j in range(n)])
recv = torch.empty(n * (rank + 1))
dist.all_to_all_single(recv, send, [rank + 1] * n, [j + 1 for j in range(n)])
check("all_to_all_single uneven", recv, torch.cat([torch.full((rank + 1,), float(j)) for j in range(n)]))

# A subgroup (pairs of neighbours along x), async_op, and a coalesced block.
x_ring = [r for r in range(n) if r // 2 == rank // 2]
groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(n // 2)]
mine = groups[rank // 2]
t = torch.tensor([1.0 + rank])
work = dist.all_reduce(t, group=mine, async_op=True)
work.wait()
check("subgroup async all_reduce", t, torch.tensor([sum(1.0 + r for r in x_ring)]))
a, c = torch.ones(2), torch.full((3,), 2.0)
with dist._coalescing_manager(async_ops=True) as cm:
    dist.all_reduce(a)
    dist.all_reduce(c)
cm.wait()
check("coalesced", torch.cat([a, c]), torch.cat([torch.full((2,), float(n)), torch.full((3,), 2.0 * n)]))

# A device mesh shaped like the torus (z, y, x): its x dimension is the x rings.
if common.UNDER_PODSIM:
    import os

    x_size = int(os.environ["PODSIM_TOPOLOGY"].split("x")[0])
    mesh = common.podsim.torch.torus_mesh()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group("x"))
    torus_x = [r for r in range(n) if r // x_size == rank // x_size]
    check("torus mesh x", t, torch.tensor([float(sum(torus_x))]))
    try:
        dist.recv(torch.empty(1))
        raise AssertionError("a receive from any source should be refused")
    except RuntimeError as e:
        assert "any source" in str(e), e

# Point to point. A ring shift in int64 with each receive posted before its send (podsim
# completes a receive at its wait, so this cannot deadlock).
nxt, prv = (rank + 1) % n, (rank - 1) % n
got = torch.empty(3, dtype=torch.int64)
ops = [
    dist.P2POp(dist.irecv, got, prv),
    dist.P2POp(dist.isend, torch.tensor([2**40 + rank, rank, -rank]), nxt),
]
for w in dist.batch_isend_irecv(ops):
    w.wait()
check("ring shift int64", got, torch.tensor([2**40 + prv, prv, -prv]))
# A receive waited on through its future (gloo's receives have no future), and one asked
# whether it completed: as with gloo, only a wait runs it, so a poll never blocks.
if common.UNDER_PODSIM:
    through_future, polled = torch.empty(1), torch.empty(1)
    work = dist.irecv(through_future, prv)
    sent = dist.isend(torch.tensor([-float(rank)]), nxt)
    work.get_future().wait()
    sent.wait()
    work = dist.irecv(polled, prv)
    dist.send(torch.tensor([float(rank)]), nxt)
    assert not work.is_completed()
    work.wait()
    assert work.is_completed()
    check("future and polled receives", torch.cat([through_future, polled]), torch.tensor([-prv, prv]))
# Blocking send and recv in bf16 between the pairs of a subgroup (dst and src are global).
peer = rank ^ 1
theirs = torch.empty(2, dtype=torch.bfloat16)
mine_bf16 = torch.tensor([rank + 0.5, -rank], dtype=torch.bfloat16)
if rank % 2 == 0:
    dist.send(mine_bf16, peer, group=mine)
    dist.recv(theirs, peer, group=mine)
else:
    dist.recv(theirs, peer, group=mine)
    dist.send(mine_bf16, peer, group=mine)
check("send/recv bf16 in a subgroup", theirs, torch.tensor([peer + 0.5, -peer]))
# The first rank to the last (the farthest chip, or another slice): tags are matched apart.
far = n - 1
if rank == 0:
    for w in [dist.isend(torch.tensor([7.0]), far, tag=7), dist.isend(torch.tensor([3.0]), far, tag=3)]:
        w.wait()
elif rank == far:
    three, seven = torch.empty(1), torch.empty(1)
    dist.recv(three, 0, tag=3)
    dist.recv(seven, 0, tag=7)
    check("tags", torch.cat([three, seven]), torch.tensor([3.0, 7.0]))
# Python objects (a size, then pickled bytes).
objects = [{"from": rank, "pair": (1, "two")}] if rank == 0 else [None]
if rank == 0:
    dist.send_object_list(objects, dst=1)
elif rank == 1:
    dist.recv_object_list(objects, src=0)
    assert objects[0] == {"from": 0, "pair": (1, "two")}, objects
common.mark_step()
print(f"rank {rank}: api ok")
dist.destroy_process_group()
