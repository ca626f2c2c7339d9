"""Host-side bookkeeping a serving loop needs around the jitted step: KV slots, req_to_token rows, batches.

This is the scheduler's side (numpy, outside jit). It hands the step a `ForwardBatch` padded to static
buckets, so the jitted step compiles once per bucket.

Every call is transactional: it checks all of its arguments first and only then changes anything, so a call
that raises leaves the allocator and the table exactly as they were. Rejected calls raise `ServingError` (a
`ValueError`) whose message names the argument and what was expected; running out of KV slots raises
`KVPoolExhausted` (also a `RuntimeError`, what it used to raise), running out of req_to_token rows
`RequestTableFull` (also an `IndexError`, what it used to raise).

Ownership: every pool slot 1..num_slots-1 is either free in the `SlotAllocator` or held by exactly one
holder: the caller (a plain `alloc`) or one `RequestTable`. Slot 0 is the padding slot and is never handed
out. Inside a table, each slot a live request lists has a reference count: a request created with
`shared_prefix_from` shares its owner's first `shared_len` slots (one more reference each), and a slot goes
back to the pool exactly once, when the last request listing it finishes (or rewinds past it: `rewind`).
Requests can finish in any order.

Pages (issue 23; `jaxattn.paging`'s layout). `SlotAllocator(num_slots, page_size=P)` hands out whole pages: page p
is the page-aligned slot run `[p * P, (p + 1) * P)`, page 0 (slots `[0, P)`) is the padding page and never handed
out, and everything above about slots holds for pages (holders, reference counts, freeing exactly once). A
request owns whole pages: `RequestTable.req_to_page[row, i]` is the page of its positions `[i * P, (i + 1) * P)`,
and it lists `ceil(cached / P)` pages (the last one may be partly filled; the next tokens go there first).
`req_to_token` is kept beside it at every page size (the slot of each cached position; at P = 1 it is
`req_to_page`). Page size 1 is exactly the slot layout and behaviour described above.

Prefix sharing with pages shares whole pages only: `add(..., shared_prefix_from=owner, shared_len=n)` shares the
owner's first `n // P` pages, and the new request starts with `cached == (n // P) * P`; the tokens of the owner's
partly shared page (`n % P` of them) are *recomputed* by the new request's next extend, into a page of its own.
Recompute, not copy: a copy would be a device-side K/V copy of every layer's pool outside the step (the table is
host-side numpy and never touches the pools), while recomputing at most P - 1 tokens costs nothing extra in the
step that extends the request anyway; it is also SGLang's rule (its radix cache matches page-aligned prefixes
only). So a page listed by two requests is always full in both (every one of its positions is cached), nobody
ever writes into it, and a page is written only by the one request that owns it alone.
"""

from __future__ import annotations

import operator

import jax.numpy as jnp
import numpy as np

from jaxattn.checks import PAGE_SIZES
from jaxattn.serving.batch import ForwardBatch, ForwardMode

_INT32_MAX = int(np.iinfo(np.int32).max)


class ServingError(ValueError):
    """A serving-layer call was rejected; nothing was changed."""


class KVPoolExhausted(ServingError, RuntimeError):
    """Not enough free KV-pool slots (also a RuntimeError, what `SlotAllocator.alloc` raised before)."""


class RequestTableFull(ServingError, IndexError):
    """No free req_to_token row (also an IndexError, what `RequestTable.add` raised before)."""


def _int(where: str, value, *, low: int = 0, high: int | None = None) -> int:
    """`value` as a Python int in [low, high]; ServingError naming `where` otherwise (bools are not ints here)."""
    if isinstance(value, (bool, np.bool_)):
        raise ServingError(f"{where} must be an int; got {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise ServingError(f"{where} must be an int; got {value!r}") from None
    if result < low or (high is not None and result > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ServingError(f"{where} must be {expected}; got {result}")
    return result


def _check_token_sequence(where: str, tokens) -> None:
    """Token ids come as a sequence (list, tuple, 1-D array): an unordered or one-shot iterable (a set, a dict, a
    generator a refused call would use up) is not one."""
    if isinstance(tokens, (str, bytes, bytearray, set, frozenset, dict)) or not hasattr(tokens, "__len__") \
            or not hasattr(tokens, "__getitem__"):
        raise ServingError(f"{where} must be a sequence of token ids (a list, tuple or 1-D array); got "
                           f"{type(tokens).__name__}")
    if getattr(tokens, "ndim", 1) != 1:  # arrays: a 0-d one has __len__ too (and raises on it)
        raise ServingError(f"{where} must be a sequence of token ids (a list, tuple or 1-D array); got a "
                           f"{tokens.ndim}-D array of shape {tuple(tokens.shape)}")


def _token_list(where: str, tokens) -> list[int]:
    """Token ids as Python ints in [0, 2**31): the step feeds them to the model as int32."""
    _check_token_sequence(where, tokens)
    return [_int(f"{where}[{i}]", t, high=_INT32_MAX) for i, t in enumerate(list(tokens))]


class SlotAllocator:
    """Hands out KV-pool slots 1..num_slots-1 (slot 0 is the padding slot), in shuffled order like a used pool;
    with `page_size` P > 1, whole pages 1..num_slots/P - 1 (page 0 is the padding page).

    `alloc(n)` gives the caller n slots; `free(slots)` takes back slots the caller got from `alloc`. Freeing a
    slot twice, slot 0, a slot outside the pool, a slot never allocated or a slot a `RequestTable` holds
    (release those with `RequestTable.finish`) raises `ServingError` and frees nothing. With P > 1 the unit is
    the page: `alloc_pages(n)` / `free_pages(pages)` (same rules, for page ids; `page_slots` gives a page's
    slots), and `alloc` / `free` raise (a slot cannot be handed out alone). At P = 1 a page is a slot, and
    `alloc_pages` / `free_pages` are `alloc` / `free`.
    """

    def __init__(self, num_slots: int, seed: int = 0, *, page_size: int = 1):
        # Slots are int32 everywhere downstream (out_cache_loc, req_to_token, the kernels' indices).
        self.num_slots = _int("SlotAllocator(num_slots)", num_slots, low=1, high=_INT32_MAX)
        page_size = _int("SlotAllocator(page_size)", page_size, low=1)
        if page_size not in PAGE_SIZES:
            raise ServingError(f"SlotAllocator(page_size) must be one of {PAGE_SIZES}; got {page_size}")
        if self.num_slots % page_size:
            raise ServingError(f"SlotAllocator(num_slots) must be a multiple of page_size {page_size} (pages are "
                               f"page-aligned runs of slots); got {self.num_slots}")
        self.page_size = page_size
        self.num_pages = self.num_slots // page_size
        # Page ids (slots at page_size 1) in a shuffled order; page 0 is never in it.
        self._free = [int(s) for s in np.random.default_rng(seed).permutation(np.arange(1, self.num_pages))]
        self._holder: dict[int, object] = {}  # allocated page -> its holder (None: the caller; else a RequestTable)

    @property
    def _unit(self) -> str:
        return "slot" if self.page_size == 1 else "page"

    def _slot_api(self, where: str) -> None:
        if self.page_size != 1:
            raise ServingError(f"{where}: this pool hands out whole pages (page_size {self.page_size}); use "
                               f"alloc_pages / free_pages (and page_slots for their slots)")

    def alloc(self, n: int) -> np.ndarray:
        """i32[n]: n free slots, now held by the caller. KVPoolExhausted when fewer than n are free."""
        self._slot_api("alloc(n)")
        return self._take(n, None, "alloc(n)")

    def free(self, slots) -> None:
        """Returns slots the caller got from `alloc` to the pool (all of them, or none when one is rejected)."""
        self._slot_api("free(slots)")
        self._release(slots, None, "free(slots)")

    def alloc_pages(self, n: int) -> np.ndarray:
        """i32[n]: n free page ids, now held by the caller. KVPoolExhausted when fewer than n are free."""
        return self._take(n, None, "alloc_pages(n)")

    def free_pages(self, pages) -> None:
        """Returns pages the caller got from `alloc_pages` (all of them, or none when one is rejected)."""
        self._release(pages, None, "free_pages(pages)")

    def page_slots(self, pages) -> np.ndarray:
        """i32[len(pages), page_size]: the slots of each page, `page * page_size + [0, page_size)`."""
        pages = [_int(f"page_slots(pages[{i}])", p, high=self.num_pages - 1)
                 for i, p in enumerate(np.asarray(pages).reshape(-1).tolist())]
        pages = np.asarray(pages, np.int64).reshape(-1)
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).astype(np.int32)

    @property
    def available(self) -> int:
        """Free slots (free pages x page_size)."""
        return len(self._free) * self.page_size

    @property
    def available_pages(self) -> int:
        return len(self._free)

    def _take(self, n, holder, where: str) -> np.ndarray:
        n = _int(where, n)
        if n > len(self._free):
            unit = self._unit
            raise KVPoolExhausted(f"KV pool exhausted: {where} asked for {n} {unit}s, {len(self._free)} free")
        out, self._free = self._free[:n], self._free[n:]
        for s in out:
            self._holder[s] = holder
        return np.asarray(out, np.int32)

    def _untake(self, slots) -> None:
        """Undoes the last `_take` exactly (the pages back at the front of the free list, in order)."""
        slots = [int(s) for s in slots]
        for s in slots:
            del self._holder[s]
        self._free = slots + self._free

    def _release(self, slots, holder, where: str) -> None:
        unit = self._unit
        if isinstance(slots, (int, np.integer)) or (isinstance(slots, np.ndarray) and slots.ndim != 1):
            raise ServingError(f"{where} must be a 1-d sequence of {unit}s; got {slots!r}")
        try:
            items = list(slots)
        except TypeError:
            raise ServingError(f"{where} must be a sequence of {unit}s; got {slots!r}") from None
        checked, seen = [], set()
        for i, s in enumerate(items):
            s = _int(f"{where}[{i}]", s, low=0)
            if s == 0:
                raise ServingError(f"{where}[{i}]: {unit} 0 is the padding {unit}; it is never allocated, so it cannot be freed")
            if s >= self.num_pages:
                raise ServingError(f"{where}[{i}]: {unit} {s} is outside the pool ({unit}s 1..{self.num_pages - 1})")
            if s in seen:
                raise ServingError(f"{where}[{i}]: {unit} {s} is listed twice")
            if s not in self._holder:
                raise ServingError(f"{where}[{i}]: {unit} {s} is not allocated (already free, or never handed out)")
            if self._holder[s] is not holder:
                owner = "a RequestTable (release it with RequestTable.finish)" if holder is None else "another holder"
                raise ServingError(f"{where}[{i}]: {unit} {s} is held by {owner}")
            seen.add(s)
            checked.append(s)
        for s in checked:
            del self._holder[s]
        self._free.extend(checked)


class Request:
    """One sequence of a `RequestTable`: its req_to_token `row`, its `tokens` (prompt + generated; the caller
    appends generated tokens) and `cached`, how many positions hold slots in the pool (their KV written by a step,
    or reserved for draft steps: `RequestTable.reserve`). `row` and `cached` are read-only: the table moves
    `cached` (schedule, reserve, rewind, accept_drafts)."""

    __slots__ = ("_row", "tokens", "_cached")

    def __init__(self, row: int, tokens, cached: int = 0):
        self._row = int(row)
        self.tokens = list(tokens)
        self._cached = int(cached)

    @property
    def row(self) -> int:
        return self._row

    @property
    def cached(self) -> int:
        return self._cached

    def __repr__(self) -> str:
        return f"Request(row={self._row}, tokens=<{len(self.tokens)} tokens>, cached={self._cached})"


class RequestTable:
    """req_to_token [max_reqs, max_context] on the host, plus the requests living in it; with pages (the
    allocator's page_size P > 1) also req_to_page [max_reqs, ceil(max_context / P)].

    The table holds the pages (slots at P = 1) its live requests list, with a reference count per page (see the
    module docstring): sharing a prefix adds a reference, finishing a request drops its references, and a page
    whose count reaches 0 goes back to the allocator. `page_table()` is the device-side table the backends take.
    """

    def __init__(self, max_reqs: int, max_context: int, allocator: SlotAllocator, *, page_size: int | None = None):
        max_reqs = _int("RequestTable(max_reqs)", max_reqs, low=1)
        self.max_context = _int("RequestTable(max_context)", max_context, low=1)
        if not isinstance(allocator, SlotAllocator):
            raise ServingError(f"RequestTable(allocator) must be a SlotAllocator; got {allocator!r}")
        if page_size is not None and _int("RequestTable(page_size)", page_size, low=1) != allocator.page_size:
            raise ServingError(f"RequestTable(page_size={page_size}) differs from the allocator's page_size {allocator.page_size}")
        self.page_size = allocator.page_size
        self.req_to_token = np.zeros((max_reqs, self.max_context), np.int32)
        # req_to_page[row, i]: the page of positions [i * P, (i + 1) * P); at P = 1 the same array as req_to_token.
        self.req_to_page = (self.req_to_token if self.page_size == 1 else
                            np.zeros((max_reqs, -(-self.max_context // self.page_size)), np.int32))
        self.allocator = allocator
        self.free_rows = list(range(max_reqs))
        self.requests: dict[int, Request] = {}
        self._refs: dict[int, int] = {}  # page (slot at P = 1) -> how many live requests list it

    def _pages(self, n_tokens: int) -> int:
        """Pages holding positions [0, n_tokens)."""
        return -(-n_tokens // self.page_size)

    def page_table(self):
        """The device-side `jaxattn.paging.PageTable` of req_to_page (for `init_forward_metadata`)."""
        from jaxattn.paging import PageTable

        return PageTable(jnp.asarray(self.req_to_page), page_size=self.page_size, num_slots=self.allocator.num_slots)

    def is_live(self, request) -> bool:
        """Whether `request` is a request of this table that has not finished."""
        return isinstance(request, Request) and self.requests.get(request.row) is request

    def slot_refs(self, slot: int) -> int:
        """How many live requests of this table list `slot`'s page (0: the table does not hold it)."""
        return self._refs.get(_int("slot_refs(slot)", slot) // self.page_size, 0)

    def page_refs(self, page: int) -> int:
        """How many live requests of this table list `page` (0: the table does not hold it)."""
        return self._refs.get(_int("page_refs(page)", page), 0)

    def _check_live(self, where: str, request) -> Request:
        if not isinstance(request, Request):
            raise ServingError(f"{where} must be a Request of this table; got {request!r}")
        if not self.is_live(request):
            raise ServingError(f"{where}: {request!r} is not a live request of this table (already finished, or from another table)")
        return request

    def add(self, tokens, shared_prefix_from: Request | None = None, shared_len: int = 0) -> Request:
        """A new request; optionally sharing the first `shared_len` cached slots of a live request of this table
        (a prefix-cache hit: the new request starts with `cached == shared_len`, and its first `shared_len`
        tokens must equal the owner's). The shared slots stay allocated until every request listing them has
        finished, whichever finishes first. RequestTableFull when no row is free.

        With pages (page_size P > 1) only whole pages are shared: the first `shared_len // P` pages, and the new
        request starts with `cached == (shared_len // P) * P`; its next extend recomputes the rest of the prefix
        into a page of its own (the module docstring says why recompute, not copy)."""
        tokens = _token_list("add(tokens)", tokens)
        if len(tokens) > self.max_context:
            raise ServingError(f"add(tokens): {len(tokens)} tokens exceed max_context {self.max_context}")
        shared_len = _int("add(shared_len)", shared_len)
        if shared_prefix_from is None:
            if shared_len:
                raise ServingError(f"add(shared_len={shared_len}) needs shared_prefix_from (the request whose slots are shared)")
        else:
            owner = self._check_live("add(shared_prefix_from)", shared_prefix_from)
            if shared_len > owner.cached:
                raise ServingError(
                    f"add(shared_len): can only share tokens that are already cached: shared_len {shared_len} > "
                    f"shared_prefix_from.cached {owner.cached}"
                )
            _check_token_sequence("add(shared_prefix_from.tokens)", owner.tokens)
            owner_prefix = _token_list("add(shared_prefix_from.tokens)", owner.tokens[:shared_len])
            if len(tokens) < shared_len or len(owner_prefix) < shared_len:
                raise ServingError(f"add(shared_len={shared_len}): the new request has {len(tokens)} tokens and "
                                   f"shared_prefix_from {len(owner_prefix)} of its first {shared_len}; both need them all")
            if tokens[:shared_len] != owner_prefix:
                raise ServingError(f"add(tokens): the first shared_len={shared_len} tokens differ from shared_prefix_from's tokens")
        if not self.free_rows:
            raise RequestTableFull(f"add: all {self.req_to_token.shape[0]} req_to_token rows (max_reqs) are in use; finish a request first")
        row = self.free_rows.pop(0)
        request = Request(row, tokens)
        full = shared_len // self.page_size * self.page_size  # whole pages only
        if full:
            self.req_to_token[row, :full] = self.req_to_token[shared_prefix_from.row, :full]
            if self.page_size != 1:
                self.req_to_page[row, : full // self.page_size] = self.req_to_page[shared_prefix_from.row, : full // self.page_size]
            for s in self.req_to_page[row, : full // self.page_size].tolist():
                self._refs[s] += 1
            request._cached = full
        self.requests[row] = request
        return request

    def _drop_references(self, pages: list[int], where: str) -> None:
        """Drops a request's reference to each of `pages` (slots at page size 1); those no other live request lists
        go back to the allocator, which checks them all before anything changes."""
        released = [p for p in pages if self._refs[p] == 1]
        what = "slots" if self.page_size == 1 else "pages"
        self.allocator._release(released, self, f"{where}: the request's {what}")
        for p in pages:
            self._refs[p] -= 1
            if not self._refs[p]:
                del self._refs[p]

    def finish(self, request: Request, keep_prefix: int = 0) -> None:
        """Releases the request's row and its references to its pages (slots at page size 1); pages no other
        live request lists go back to the pool (each exactly once).

        `keep_prefix` is accepted for compatibility and changes nothing: callers passed the length of a prefix
        shared with another request so that finishing would not free it; the reference counts now keep shared
        slots allocated exactly as long as a live request lists them. It must be an int in [0, cached].
        """
        request = self._check_live("finish(request)", request)
        _int("finish(keep_prefix)", keep_prefix, high=request.cached)
        self._drop_references(self.req_to_page[request.row, : self._pages(request.cached)].tolist(), "finish")
        self.req_to_token[request.row] = 0
        self.req_to_page[request.row] = 0
        del self.requests[request.row]
        self.free_rows.append(request.row)

    def rewind(self, request: Request, cached: int) -> int:
        """Drops the request's cached tokens from position `cached` on; returns its new `cached`.

        For a speculative verify step's rejected drafts (`schedule` gave every draft a slot; keep the accepted ones:
        `rewind(request, request.cached - rejected)`) or a step that failed after `schedule`. The pages (slots at page
        size 1) past the new end drop this request's reference, those no other live request lists go back to the pool
        (each exactly once, as `finish` does), and the request's req_to_token / req_to_page entries past the end are
        zeroed. `request.tokens` is the caller's and stays as it is: replace the rejected tokens before the next
        `schedule`. With pages (P > 1), a rewind into a page another request also lists (a shared prefix page, always
        full) drops that page too, so it is never written again: the new `cached` is its first position, and the next
        extend recomputes the rest into a page of the request's own (as `add` does with a partly shared page).
        Checked first (a live request of this table; `cached` an int in [0, request.cached]); a rejected call changes
        nothing. As with `finish`, call it once the step that writes those slots has run (or failed): a batch scheduled
        before still lists them, and the pool may hand them to another request."""
        request = self._check_live("rewind(request)", request)
        new_cached = _int("rewind(cached)", cached, high=request.cached)
        P, row = self.page_size, request.row
        kept = self._pages(new_cached)
        if new_cached % P and self._refs[int(self.req_to_page[row, kept - 1])] > 1:
            kept -= 1  # a shared page is full and read only: this request will not write its tail
            new_cached = kept * P
        dropped = self.req_to_page[row, kept : self._pages(request.cached)].tolist()
        self._drop_references(dropped, "rewind")
        self.req_to_token[row, new_cached : request.cached] = 0
        self.req_to_page[row, kept : kept + len(dropped)] = 0
        request._cached = new_cached
        return new_cached

    def reserve(self, request: Request, n: int) -> np.ndarray:
        """i32[n]: slots for the request's next n positions, held and listed (`cached` advances by n) without a step:
        the draft phase of speculative decoding, whose draft steps write them (`jaxattn.backends.triton.
        draft_decode_metadata` reads branch t's depth-j slot at position cached + t * steps + j: reserve topk * steps),
        then `rewind(request, cached)` gives them back before the verify step. With pages the request's partly filled
        last page is used first, then whole fresh pages, as `schedule` does. Checked first (a live request, n >= 0,
        cached + n <= max_context; KVPoolExhausted without enough free slots / pages); a rejected call changes
        nothing. `request.tokens` is not read."""
        request = self._check_live("reserve(request)", request)
        n = _int("reserve(n)", n, high=self.max_context - request.cached)
        need = self._pages(request.cached + n) - self._pages(request.cached)
        if need > self.allocator.available_pages:
            unit = "slots" if self.page_size == 1 else f"pages (page_size {self.page_size})"
            raise KVPoolExhausted(f"KV pool exhausted: reserve needs {need} {unit}, "
                                  f"{self.allocator.available_pages} free")
        new_pages = self.allocator._take(need, self, "reserve")
        own = self._new_slots(request, n, new_pages)
        self._commit_slots(request, own, new_pages)
        return own

    def accept_drafts(self, request: Request, first: int, kept) -> int:
        """After a verify step over a draft tree: keeps the tokens `kept` of the request's cached tokens from position
        `first` on (indices counted from `first`, increasing: the accepted path in the tree's topological order) as
        positions first, first + 1, ...; the other tokens' slots from `first` on go back. Returns the new `cached`,
        first + len(kept).

        The kept tokens' K/V stay where the verify step wrote them, at the positions of their depth in the tree, which
        the accepted path's tokens now hold: no K/V moves. A path that is not a prefix of the verify order (a branch
        other than the first) moves slots to other positions, which whole pages cannot do: with page_size > 1 such a
        path takes `accept_drafts_by_copy` (K/V copies), and a slot another request lists never moves. As `rewind`, the
        caller's `request.tokens` stay as they are (put the accepted path there), and the call is checked first and
        transactional.
        """
        request = self._check_live("accept_drafts(request)", request)
        first, kept = self._accepted_path("accept_drafts", request, first, kept)
        if kept == list(range(len(kept))):  # a prefix of the verify order: nothing moves
            return self.rewind(request, first + len(kept))
        row = request.row
        slots = self.req_to_token[row, first : request.cached].tolist()
        if self.page_size != 1:
            raise ServingError(f"accept_drafts(kept={kept}): with page_size {self.page_size} a kept token cannot move "
                               f"to another position of its page; use accept_drafts_by_copy (K/V copies)")
        self._check_unshared("accept_drafts", request, first, range(first, request.cached))
        kept_slots, kept_rows = [slots[i] for i in kept], set(kept)
        self._drop_references([s for i, s in enumerate(slots) if i not in kept_rows], "accept_drafts")
        self.req_to_token[row, first : request.cached] = 0
        self.req_to_token[row, first : first + len(kept)] = kept_slots
        request._cached = first + len(kept)
        return request.cached

    def accept_drafts_by_copy(self, request: Request, first: int, kept) -> tuple[np.ndarray, np.ndarray]:
        """`accept_drafts` at any page size: the kept tokens take positions first, first + 1, ... in the slots already
        listed there, so their K/V must be copied. Returns (src, dst), i32[moves] each: copy the K/V of slot src[i]
        into slot dst[i] in every layer's pool (`jaxattn.serving.move_kv`, jittable) before the next step writes into
        the pool, since the rejected tokens' slots, sources among them, go back to it here. Only the kept tokens that
        change position move; the table's side is then `rewind(request, first + len(kept))` (a prefix of the verify
        order moves nothing: then it is only that). Checked first as `accept_drafts` (and a position taking a kept
        token must not be in a page another request lists); transactional."""
        request = self._check_live("accept_drafts_by_copy(request)", request)
        first, kept = self._accepted_path("accept_drafts_by_copy", request, first, kept)
        slots = self.req_to_token[request.row, first : request.cached]
        moved = [j for j, i in enumerate(kept) if i != j]
        self._check_unshared("accept_drafts_by_copy", request, first, [first + j for j in moved])
        src = np.array([slots[kept[j]] for j in moved], np.int32)
        dst = np.array([slots[j] for j in moved], np.int32)
        self.rewind(request, first + len(kept))
        return src, dst

    def _accepted_path(self, where: str, request: Request, first, kept) -> tuple[int, list[int]]:
        """(first, kept) checked: first in [0, cached], kept increasing indices of the tokens from `first` on."""
        first = _int(f"{where}(first)", first, high=request.cached)
        drafts = request.cached - first
        if isinstance(kept, (int, np.integer)) or not hasattr(kept, "__len__"):
            raise ServingError(f"{where}(kept) must be a sequence of token indices; got {kept!r}")
        kept = [_int(f"{where}(kept[{i}])", k, high=drafts - 1) for i, k in enumerate(list(kept))]
        if any(b <= a for a, b in zip(kept, kept[1:])):
            raise ServingError(f"{where}(kept) must be increasing (a path in the tree's topological order); got {kept}")
        return first, kept

    def _check_unshared(self, where: str, request: Request, first: int, positions) -> None:
        """Raises if the slot of one of the request's `positions` is in a page another request also lists."""
        slots = self.req_to_token[request.row]
        shared = [p for p in positions if self._refs[int(slots[p]) // self.page_size] > 1]
        if shared:
            raise ServingError(f"{where}(first={first}): position {shared[0]} is shared with another request; "
                               f"its slot cannot take another token")

    def schedule(self, requests: list[Request], new_counts: list[int], *, mode: ForwardMode, batch_bucket: int,
                 token_bucket: int, max_extend_len: int, kv_capacity: int, max_seq_len: int):
        """Allocates slots for each request's next `new_counts` tokens and builds the padded step inputs.
        With pages, the new tokens fill the request's partly filled last page first, then fresh whole pages.

        Returns (ForwardBatch, token_ids i32[token_bucket]); the requests' `cached` counts advance.

        `mode` is EXTEND, DRAFT_EXTEND, DECODE (exactly one new token per request; token_bucket == batch_bucket)
        or IDLE (no new tokens). For TARGET_VERIFY, schedule in EXTEND mode and replace `mode` and
        `custom_mask` of the batch. Checked before anything is allocated: one count per request, each an int
        >= 0 and <= max_extend_len; every request live in this table and listed once; cached + count within
        max_context, within the request's tokens and within max_seq_len; len(requests) <= batch_bucket; the
        total new tokens <= token_bucket; the total keys (sum of seq_lens) <= kv_capacity; enough free slots
        for the whole batch (KVPoolExhausted otherwise; with pages, enough free pages).
        """
        if not isinstance(mode, ForwardMode):
            raise ServingError(f"schedule(mode) must be a ForwardMode; got {mode!r}")
        if mode == ForwardMode.TARGET_VERIFY:
            raise ServingError("schedule(mode=TARGET_VERIFY): schedule in EXTEND mode, then replace mode and custom_mask of the batch")
        # The step's arrays are int32 and indexed by int32: every size at most 2**31 - 1.
        batch_bucket = _int("schedule(batch_bucket)", batch_bucket, low=1, high=_INT32_MAX)
        token_bucket = _int("schedule(token_bucket)", token_bucket, low=1, high=_INT32_MAX)
        max_extend_len = _int("schedule(max_extend_len)", max_extend_len, low=1, high=_INT32_MAX)
        kv_capacity = _int("schedule(kv_capacity)", kv_capacity, low=1, high=_INT32_MAX)
        max_seq_len = _int("schedule(max_seq_len)", max_seq_len, low=1, high=_INT32_MAX)
        if mode == ForwardMode.DECODE and token_bucket != batch_bucket:
            raise ServingError(f"schedule: in DECODE mode token b is sequence b, so token_bucket ({token_bucket}) must equal batch_bucket ({batch_bucket})")
        try:
            requests, new_counts = list(requests), list(new_counts)
        except TypeError:
            raise ServingError("schedule(requests, new_counts) must be sequences") from None
        if len(new_counts) != len(requests):
            raise ServingError(f"schedule(new_counts) has {len(new_counts)} counts for {len(requests)} requests; give one count per request")
        if len(requests) > batch_bucket:
            raise ServingError(f"schedule(requests): {len(requests)} requests exceed the batch bucket {batch_bucket}")
        counts, seen, token_rows = [], set(), []
        for b, (request, n) in enumerate(zip(requests, new_counts)):
            request = self._check_live(f"schedule(requests[{b}])", request)
            if id(request) in seen:
                raise ServingError(f"schedule(requests[{b}]): request row {request.row} is listed twice")
            seen.add(id(request))
            n = _int(f"schedule(new_counts[{b}])", n)
            if mode == ForwardMode.DECODE and n != 1:
                raise ServingError(f"schedule(new_counts[{b}]) = {n}: DECODE steps take exactly one new token per request")
            if mode == ForwardMode.IDLE and n != 0:
                raise ServingError(f"schedule(new_counts[{b}]) = {n}: IDLE steps take no new tokens")
            if n > max_extend_len:
                raise ServingError(f"schedule(new_counts[{b}]): request row {request.row}: {n} new tokens exceed max_extend_len {max_extend_len}")
            end = request.cached + n
            if end > self.max_context:
                raise ServingError(
                    f"schedule(new_counts[{b}]): request row {request.row} has {request.cached} cached tokens; {n} more exceed max_context {self.max_context}"
                )
            _check_token_sequence(f"schedule(requests[{b}].tokens)", request.tokens)
            if end > len(request.tokens):
                raise ServingError(
                    f"schedule(new_counts[{b}]): request row {request.row} has {len(request.tokens)} tokens, {request.cached} cached; "
                    f"{n} more need tokens up to position {end - 1} (append them to request.tokens first)"
                )
            if end > max_seq_len:
                raise ServingError(f"schedule(new_counts[{b}]): request row {request.row}: seq_len {end} exceeds max_seq_len {max_seq_len}")
            token_rows.append(_token_list(f"schedule(requests[{b}].tokens[{request.cached}:{end}])", request.tokens[request.cached : end]))
            counts.append(n)
        total = sum(counts)
        if total > token_bucket:
            raise ServingError(f"schedule(new_counts): {total} new tokens exceed the token bucket {token_bucket}")
        keys = sum(r.cached + n for r, n in zip(requests, counts))
        if keys > kv_capacity:
            raise ServingError(f"schedule: the batch lists {keys} keys (sum of seq_lens), more than kv_capacity {kv_capacity}")
        P = self.page_size
        need = [self._pages(r.cached + n) - self._pages(r.cached) for r, n in zip(requests, counts)]
        if sum(need) > self.allocator.available_pages:
            if P == 1:
                raise KVPoolExhausted(f"KV pool exhausted: schedule needs {total} slots for the batch, {self.allocator.available} free")
            raise KVPoolExhausted(f"KV pool exhausted: schedule needs {sum(need)} pages (page_size {P}) for the batch, "
                                  f"{self.allocator.available_pages} free")

        # Everything checked: build the step inputs, then commit.
        pages = self.allocator._take(sum(need), self, "schedule")
        try:  # any failure before the commit (memory for the buffers included) gives the pages back
            req_pool_indices = np.zeros(batch_bucket, np.int32)
            seq_lens = np.zeros(batch_bucket, np.int32)
            extend_lens = np.zeros(batch_bucket, np.int32)
            out_cache_loc = np.zeros(token_bucket, np.int32)
            positions = np.zeros(token_bucket, np.int32)
            token_ids = np.zeros(token_bucket, np.int32)
            cursor, page_cursor, per_request = 0, 0, []
            for b, (request, n, ids, k) in enumerate(zip(requests, counts, token_rows, need)):
                start = request.cached
                new_pages = pages[page_cursor : page_cursor + k]
                page_cursor += k
                own = self._new_slots(request, n, new_pages)
                token_pos = b if mode == ForwardMode.DECODE else cursor
                out_cache_loc[token_pos : token_pos + n] = own
                positions[token_pos : token_pos + n] = np.arange(start, start + n)
                token_ids[token_pos : token_pos + n] = ids
                req_pool_indices[b] = request.row
                seq_lens[b] = start + n
                extend_lens[b] = n
                per_request.append((own, new_pages))
                cursor += n
            batch = ForwardBatch(
                req_pool_indices=jnp.asarray(req_pool_indices),
                seq_lens=jnp.asarray(seq_lens),
                extend_lens=jnp.asarray(extend_lens),
                out_cache_loc=jnp.asarray(out_cache_loc),
                positions=jnp.asarray(positions),
                mode=mode,
                max_extend_len=max_extend_len,
                kv_capacity=kv_capacity,
                max_seq_len=max_seq_len,
            )
            token_ids = jnp.asarray(token_ids)
        except BaseException:
            self.allocator._untake(pages)
            raise
        for request, n, (own, new_pages) in zip(requests, counts, per_request):
            self._commit_slots(request, own, new_pages)
        return batch, token_ids

    def _new_slots(self, request: Request, n: int, new_pages: np.ndarray) -> np.ndarray:
        """i32[n]: the slots of the request's next n positions: its partly filled last page first, then `new_pages`."""
        P, start = self.page_size, request.cached
        row_pages = np.concatenate([self.req_to_page[request.row, : self._pages(start)], new_pages])
        pos = np.arange(start, start + n)
        return (row_pages[pos // P] * P + pos % P).astype(np.int32)

    def _commit_slots(self, request: Request, own: np.ndarray, new_pages: np.ndarray) -> None:
        """Lists `own` (from `_new_slots`) as the request's next positions and holds `new_pages` for it."""
        first, start = self._pages(request.cached), request.cached
        self.req_to_token[request.row, start : start + len(own)] = own
        if self.page_size != 1:
            self.req_to_page[request.row, first : first + len(new_pages)] = new_pages
        for p in new_pages.tolist():
            self._refs[p] = 1
        request._cached += len(own)
