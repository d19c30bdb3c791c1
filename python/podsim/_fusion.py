"""The eager `fused` mode's kernels: element-wise ops (and other passes over HBM) fused as XLA
fuses them, for the chip's clock and for the rank's HBM.

An op joins the open kernel that produced one of its inputs (merging kernels it reads from
several), whatever unrelated ops the program runs in between; an op reading no open kernel's
result starts a kernel of its own. A kernel closes when a matrix product or an attention
kernel reads one of its results, when too many kernels are open, or at the step's end. A
closed kernel reads each of its inputs from HBM once and writes each of its results once. The
compute taken at a collective includes what open kernels have read so far (`price_open`);
their writes are priced when they close.

A result the kernel's own ops read (an intermediate) is never written if nothing keeps it once
the kernel closes. If something does (autograd saved it for backward, the program holds it),
the kernel either writes it or, when its sources in HBM are no larger than it is, keeps those
sources alive instead, and whoever reads it later recomputes it from them (the f32 copy of bf16
logits, and their log-softmax, are recomputed from the logits, not stored). An unwritten result
holds no HBM (`Memory.unwritten`).
"""

import weakref

import torch

# Open kernels past this many: the oldest closes. Bounds the work per op and how late a
# kernel's results are counted in HBM.
_OPEN_KERNELS = 8


def tensors_of(x):
    """The tensors of an op's argument or result (a tensor, or a list or tuple of them)."""
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (list, tuple)):
        return tuple(y for y in x if isinstance(y, torch.Tensor))
    return ()


class _Kernel:
    """One fused kernel being built."""

    __slots__ = ("outputs", "inputs", "read")

    def __init__(self):
        # key -> [bytes, weak reference to the storage, keys of the op's inputs, read inside
        # the kernel, op, the storage's address], in the order the ops produced them.
        self.outputs = {}
        # key -> (bytes, weak reference to the storage, bytes read for it) of what the kernel
        # reads from HBM; `read` is what of that has not been priced yet (`Fusion.price_open`).
        # Both weak: an open kernel must not keep alive what the program has freed (the HBM
        # count would hold it: FSDP2's gather buffers, written by a copy-in kernel, stayed
        # counted after FSDP freed them); a source still alive when the kernel closes can be
        # recomputed from, a result freed before is one written and freed.
        self.inputs = {}
        self.read = 0

    def absorb(self, other):
        """`other`'s ops, which read nothing of this kernel's, join it."""
        self.outputs.update(other.outputs)
        for key, entry in other.inputs.items():
            self.inputs.setdefault(key, entry)
        self.read += other.read


class Fusion:
    """The open kernels of one rank, and the values closed ones left unwritten."""

    def __init__(self):
        self.open = []  # oldest first
        self.producer = {}  # key of an open kernel's result -> that kernel
        # Results kept unwritten: key -> (bytes read to recompute it, {source key: (bytes,
        # storage)}); the entry keeps the sources alive until the value is freed (`forget`).
        self.recomputable = {}
        self.memory = None
        # A storage's key: a number of its own for as long as it lives, never another's. Its
        # address (`_cdata`) would not do, since kernels hold storages weakly: a freed
        # storage's address comes back as a new one's, which would pass for the old value
        # (a sum's 4-byte result taken for the product its exp was computed from).
        self._keys = {}  # address -> (weak reference to the storage, key)
        self._last_key = 0

    def key(self, storage):
        """`storage`'s key (see `_keys`)."""
        address = storage._cdata
        known = self._keys.get(address)
        if known is not None and known[0]() is storage:
            return known[1]
        self._last_key += 1
        self._keys[address] = (weakref.ref(storage), self._last_key)
        return self._last_key

    def add(self, compute, args, out, func):
        """An op that is a pass over HBM."""
        self.memory = compute.memory
        inputs = [t for a in args for t in tensors_of(a)]
        storages = [t.untyped_storage() for t in inputs]
        keys = [self.key(s) for s in storages]
        results = []
        for t in tensors_of(out):
            storage = t.untyped_storage()
            results.append((t, storage, self.key(storage)))
        # An op writing into an open kernel's result (`out=`, in place) joins that kernel too.
        kernel = self._kernel_for(compute, keys + [key for _, _, key in results])
        for t, storage, key in zip(inputs, storages, keys):
            produced = kernel.outputs.get(key)
            if produced is not None:
                produced[3] = True
            elif key not in kernel.inputs:
                again = self.recomputable.get(key)
                cost = t.nbytes if again is None else again[0]
                kernel.read += cost
                kernel.inputs[key] = (t.nbytes, weakref.ref(storage), cost)
        for t, storage, key in results:
            if key not in kernel.outputs:
                address = storage._cdata
                # Freed while the kernel is open, a result leaves `Memory.unwritten` at once:
                # its address may be a new storage's before the kernel closes.
                ref = weakref.ref(storage, lambda _, k=key, a=address: self._settled(k, a))
                kernel.outputs[key] = [t.nbytes, ref, keys, False, func, address]
                self.producer[key] = kernel
                if self.memory is not None and address not in self.memory.live:
                    self.memory.unwritten.add(address)

    def _kernel_for(self, compute, keys):
        """The open kernel an op touching `keys` joins: the one that produced them (merged
        into the oldest when several did), else a new one."""
        found = []
        for key in keys:
            kernel = self.producer.get(key)
            if kernel is not None and kernel not in found:
                found.append(kernel)
        if not found:
            kernel = _Kernel()
            self.open.append(kernel)
            if len(self.open) > _OPEN_KERNELS:
                self._close(compute, self.open[0])
            return kernel
        found.sort(key=self.open.index)
        kernel = found[0]
        for other in found[1:]:
            kernel.absorb(other)
            for key in other.outputs:
                self.producer[key] = kernel
            self.open.remove(other)
        return kernel

    def reads(self, compute, tensors):
        """A kernel that is not a pass (a matrix product, attention, a collective) reads
        `tensors`: the open kernels producing them close first. Returns the bytes read to
        recompute those of them left unwritten."""
        extra = 0
        for t in tensors:
            key = self.key(t.untyped_storage())
            kernel = self.producer.get(key)
            if kernel is not None:
                self._close(compute, kernel)
            again = self.recomputable.get(key)
            if again is not None:
                extra += again[0]
        return extra

    def close_all(self, compute):
        while self.open:
            self._close(compute, self.open[0])

    def price_open(self, compute):
        """The rank's compute is taken (a collective is issued): what the open kernels have
        read so far is priced now, and they stay open. Whether their results are written is
        known only when they close, so a gradient in flight between two autograd nodes when
        FSDP's hook issues a reduce-scatter is not counted as stored."""
        for kernel in self.open:
            compute._pass_bytes += kernel.read
            kernel.read = 0

    def _close(self, compute, kernel):
        """Ends `kernel`: prices it, and decides for each result whether it is in HBM."""
        self.open.remove(kernel)
        for key in kernel.outputs:
            if self.producer.get(key) is kernel:
                del self.producer[key]
        # What a result can be recomputed from: the kernel's inputs (for an unwritten one, its
        # own sources) and the results it writes.
        in_hbm = {}
        for key, (n, ref, _) in kernel.inputs.items():
            storage = ref()
            if storage is not None:
                in_hbm[key] = (n, storage)
        for key in kernel.inputs:
            if key in self.recomputable:
                in_hbm.update(self.recomputable[key][1])
        unwritten = {}  # key -> sources, for this kernel's results not written
        written = 0
        for key, (n, ref, operands, consumed, func, address) in kernel.outputs.items():
            sources = self._sources(operands, unwritten, kernel)
            storage = ref()  # alive only if someone besides the kernel keeps it
            if storage is None:
                if consumed:
                    unwritten[key] = sources
                else:
                    written += n  # written, then freed
                self._settled(key, address)
                continue
            if consumed and all(s in in_hbm for s in sources):
                cost = sum(in_hbm[s][0] for s in sources)
                if cost <= n:  # recomputing reads no more than storing would
                    unwritten[key] = sources
                    self.recomputable[key] = (cost, {s: in_hbm[s] for s in sources})
                    weakref.finalize(storage, self.forget, key, address)
                    continue
            written += n
            in_hbm[key] = (n, storage)
            self._settled(key, address)
            if self.memory is not None:
                self.memory.track(storage, func)
        compute._pass_bytes += kernel.read + written
        compute._kernels += 1

    def _sources(self, operands, unwritten, kernel):
        """The values in HBM an op's result is computed from."""
        sources = set()
        for operand in operands:
            if operand in unwritten:
                sources |= unwritten[operand]
            elif operand in self.recomputable and operand not in kernel.outputs:
                sources.update(self.recomputable[operand][1])
            else:
                sources.add(operand)
        return sources

    def forget(self, key, address):
        """Storage `key` (at `address`) was freed: its sources may go too."""
        self.recomputable.pop(key, None)
        self._settled(key, address)

    def _settled(self, key, address):
        """Storage `key` at `address` is counted now, or never will be (unless the address is
        another live storage's by now)."""
        known = self._keys.get(address)
        if known is not None and known[1] != key and known[0]() is not None:
            return
        if self.memory is not None:
            self.memory.unwritten.discard(address)
