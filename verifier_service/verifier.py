"""The verifier: checks many sessions' token trees against the target model in one forward pass.

Per session and round: sync the session's tokens (the client sends only what changed), feed the last committed token
followed by the tree's nodes with tree attention, shape the target's logits into p as the request asked (the
model-execution layer, `specfleet.engine`, runs the pass and shapes), run `verification.verify_trees` (rejection
sampling), or, for greedy and drafter-invariant sessions, `verify_trees_greedy` on the target's fixed token at every
row (the argmax, or the winner of the seeded exponential race), keep the KV of the accepted path only, and append the
accepted tokens and the next token to the session. A session may ask for several passes in one call (`plain_steps`):
its tree, if it has one, is verified in the first, and each further pass decodes one token plainly, all such sessions
of the batch together, each pass exactly the one a round of its own would run on the tokens emitted so far, until each
has its passes, ends its sequence, or another call waits for the model (`waiting`), so that no caller waits behind
them for more than one pass. A session may also ask the verifier to draft in its plain passes (`lookup_tokens`): each
such pass first looks the session's own context up for a continuation (n-gram lookup, `specfleet.engine.ngram`, as
vLLM's prompt lookup does) and verifies that chain in the same pass, so repeating text advances several tokens a pass
with no drafter and no round trip; a pass with no chain is a plain pass.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from specfleet.engine import LoadedModel, SessionStore, UnknownSession, prefill, prefill_shares, session_guide, shaping, tree_pass
from specfleet.engine.ngram import lookup_chain, next_token_counts
from specfleet.engine.prompt_logprobs import PromptLogprobs
from specfleet.sampling import STREAM_DRAFT, SamplingParams
from verifier_service.lookup import LookupPolicy
from verifier_service.verification import verify_trees, verify_trees_greedy

log = logging.getLogger(__name__)


@dataclass
class VerifyItem:
    session_id: str
    prefix_length: int
    new_token_ids: list[int]
    sampling: SamplingParams
    tree_tokens: list[int] = field(default_factory=list)
    tree_parents: list[int] = field(default_factory=list)
    # Per node: (token ids, probs) of the distribution its token was drawn from.
    proposals: list[tuple[list[int], list[float]]] = field(default_factory=list)
    # Return the emitted tokens' log-probabilities, and this many alternatives each.
    logprobs: bool = False
    top_logprobs: int = 0
    # Set: return the context's log-probabilities (vLLM's prompt_logprobs) with this many alternatives each.
    prompt_logprobs: int | None = None
    # Forward passes for this session in this call: the first verifies its tree (an empty tree: decodes a token), each
    # further one decodes a token plainly (1: the tree's pass alone).
    plain_steps: int = 1
    # Tokens each plain pass of a call of several (an empty tree, plain_steps > 1) may draft by n-gram lookup in the
    # session's own context and verify in the same pass; 0: none (`Verifier._looked_up`).
    lookup_tokens: int = 0
    # Tokens the call may emit for the session at most beyond its tree's accepted ones (0: its passes bound them).
    max_tokens: int = 0
    cache_salt: str = ""  # read with prefix_length = 0: its cached blocks are shared only with its salt's sessions
    # Set by the verifier on a pass whose tree is its own lookup, not the client's: each token's confidence.
    lookup_confidences: list[float] = field(default_factory=list)
    # Set by the verifier on a pass whose tree is the text the session's guide forces (`_forced`): its own, never a
    # client's to learn from.
    forced: bool = False


@dataclass
class VerifyResult:
    session_id: str
    known: bool
    prefilling: bool = False  # its new tokens are being prefilled in chunks: nothing verified this call
    accepted_nodes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # When the item asked: see specfleet.engine.shaping.token_logprobs.
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)  # top_logprobs per token, flattened
    top_logprobs: list[float] = field(default_factory=list)
    prompt: PromptLogprobs | None = None  # when the item asked for prompt_logprobs: its context's, tokens 1..
    steps: int = 0  # forward passes that emitted this session's tokens
    # Tokens the verifier's lookup drafted in this call's plain passes, and how many of them the target accepted.
    lookup_proposed: int = 0
    lookup_accepted: int = 0
    cached_tokens: int = 0  # of its prompt, the tokens the prefix cache held (vLLM's cached_tokens; `Session.cached_tokens`)


def passes(results: list[VerifyResult]) -> int:
    """Forward passes a batch's verification ran (its sessions' plain steps run together)."""
    return max((r.steps for r in results), default=0) or 1


# The verifier's lookup: suffixes of 4 down to 3 tokens, the next tokens of their 16 most recent earlier
# occurrences. A suffix of 1 or 2 tokens matches more often and is right less often: on the demo workloads the
# longer suffixes give the most tokens per unit of pass time, batched or not (docs/benchmarks/lookup.md).
LOOKUP_NGRAM_MAX, LOOKUP_NGRAM_MIN, LOOKUP_MATCHES = 4, 3, 16
# Tokens a guide forces that one pass verifies at most (`_forced`).
MAX_FORCED = 16
# `_left` without a cap.
NO_CAP = 2**31
# Its draws' random stream, apart from the verification's and the drafters' (obligation 1's proviso).
LOOKUP_STREAM = STREAM_DRAFT + zlib.crc32(b"verifier lookup")


def _left(item: VerifyItem, done: VerifyResult | None) -> int:
    """Tokens the session's passes may still emit in this call (`max_tokens` less what they emitted beyond its tree's
    accepted tokens; `done`: the call's results so far, None before its first pass), or NO_CAP without a cap."""
    if not item.max_tokens:
        return NO_CAP
    return item.max_tokens - (len(done.token_ids) - len(done.accepted_nodes) if done else 0)


def _plain(item: VerifyItem) -> VerifyItem:
    """The item a pass after its tree's runs: the same session and sampling, an empty tree."""
    return replace(item, tree_tokens=[], tree_parents=[], proposals=[], lookup_confidences=[], forced=False) if item.tree_tokens else item


class Verifier:
    def __init__(self, loaded: LoadedModel, store: SessionStore, max_prefill_tokens: int = 0):
        self.loaded = loaded
        self.store = store
        # Chunked prefill: positions a batch prefills at most (0: no limit); see `_chunk`.
        self.max_prefill_tokens = max_prefill_tokens
        self.sessions_verified = 0
        # Whether another call waits for the model (the batch queue's): plain steps stop at the next pass.
        self.waiting: Callable[[], bool] = lambda: False
        # The batch queue's `join_running` and `answer` (specfleet/batching.py): waiting calls of one pass join a batch's last
        # step, up to max_batch_items sessions in that pass. Without a queue, none joins.
        self.join_running: Callable[[Callable[[list], bool], int], list] = lambda accept, room: []
        self.answer: Callable[..., None] = lambda joined, results, batch_size, share=None: None
        self.max_batch_items = 0
        # How far lookup chains go: as far as they pay for their rows in this verifier's passes (lookup.py).
        self.lookup = LookupPolicy()

    def verify_batch(self, items: list[VerifyItem]) -> list[VerifyResult]:
        with self.store.lock:
            return self._verify_batch(items)

    def _verify_batch(self, items: list[VerifyItem]) -> list[VerifyResult]:
        results: list[VerifyResult | None] = [None] * len(items)
        live = self._synced(items, results)
        protect = {item.session_id for _, item, _ in live}
        if live:
            for (idx, _, _), result in zip(live, self._verify(self._looked_up(live, results))):
                results[idx] = result
            protect |= self._plain_steps(live, results)
        self.store.enforce_budget(protect=protect)
        return results

    def _synced(self, items: list[VerifyItem], results: list) -> list[tuple[int, VerifyItem, object]]:
        """The items' sessions synced to the tokens they sent, within the chunked-prefill budget: (index, item,
        session) for each to verify in this pass; the others' results (unknown, prefilling) set in `results`."""
        live = []
        for idx, item in enumerate(items):
            try:
                session = self.store.sync(item.session_id, item.prefix_length, item.new_token_ids, item.cache_salt)
            except UnknownSession:
                results[idx] = VerifyResult(item.session_id, known=False)
                continue
            owed = session.prompt_logprobs
            if item.prompt_logprobs is not None and (owed is None or owed.top != item.prompt_logprobs):
                session.prompt_logprobs = PromptLogprobs(item.prompt_logprobs)
                session.crop_kv(0)  # its prefill computes every position's logits, none from the cache
            live.append((idx, item, session))
        live = self._chunk(live, results)
        self.sessions_verified += len(live)
        return live

    def _plain_steps(self, live: list, results: list[VerifyResult]) -> set[str]:
        """Further one-token passes for the sessions that asked for them, all together, after the first pass verified
        their trees: a session's step is the pass a round of its own would run on the same tokens, an empty tree (the
        same shaping and seeded noise at the same positions), so its tokens are the target's whatever the number of
        steps and whatever its tree accepted (a step may verify the session's lookup, `_looked_up`: the tokens are the
        same, more of them a pass). A session stops after its plain steps' passes, at the model's end of sequence (the
        client decides whether it ends there), at the end of the model's context or at what the client keeps
        (`max_tokens`), the batch once another call
        waits for the model: calls of one pass (a first round, a drafting round's tree) join the step about to run
        (`_join_last`), which is then the batch's last, others wait for the pass under way only. Returns the sessions
        of the calls that joined."""
        eos, context = self.loaded.eos_token_id, self.loaded.max_context
        live = [(idx, _plain(item), session) for idx, item, session in live if item.plain_steps > 1]  # the rest took their pass
        while True:
            more = [
                (idx, item, session)
                for idx, item, session in live
                if results[idx].steps < item.plain_steps
                and eos not in results[idx].token_ids
                and len(session.token_ids) < context
                and _left(item, results[idx]) > 0
            ]
            if not more:
                return set()
            stepping = self._looked_up(more, results)
            if self.waiting():
                return self._join_last(stepping, results)
            self._step(stepping, results, self._verify(stepping))
            live = more

    def _looked_up(self, live: list, results: list) -> list:
        """The pass's sessions, each that asked for `lookup_tokens` in a call of several passes with an empty tree
        given a chain looked up in its own context (`specfleet.engine.ngram.lookup_chain`, drawn from exactly the
        distribution it sends, on a stream of its own), within the model's context and the call's `max_tokens` with
        the token the pass emits after it, and as far as its tokens are likely enough to be accepted to pay for
        their rows (`LookupPolicy`). A session without a chain keeps its empty tree: a plain pass."""
        asking = [at for at, (_, item, _) in enumerate(live) if item.lookup_tokens and item.plain_steps > 1 and not item.tree_tokens]
        live = self._forced(live, asking, results)
        asking = [at for at in asking if not live[at][1].forced]
        chains = self.lookup.for_pass(len(live)) if asking else None
        if chains is None:
            return live
        eligible = []  # (position in live, the most tokens its chain may take, its first position's lookup)
        for at in asking:
            idx, item, session = live[at]
            context_room = self.loaded.max_context - len(session.token_ids)
            room = min(context_room, _left(item, results[idx])) - 1  # the pass's own token after the chain
            most = min(item.lookup_tokens, room)
            if most > 0:
                first = next_token_counts(session.token_ids, LOOKUP_NGRAM_MAX, LOOKUP_NGRAM_MIN, LOOKUP_MATCHES)
                if first[0]:
                    eligible.append((at, most, first))
        if not chains.pays([max(counts) / (sum(counts) + 1) for _, _, (_, counts) in eligible]):
            return live
        out = list(live)
        for at, most, first in eligible:
            idx, item, session = live[at]
            chain, proposals, confidences = lookup_chain(
                session.token_ids, most, item.sampling, LOOKUP_STREAM, LOOKUP_NGRAM_MAX, LOOKUP_NGRAM_MIN, LOOKUP_MATCHES, chains.worth, first
            )
            if chain and item.sampling.guide is not None and (item.sampling.greedy or item.sampling.raced):
                # A token its guide disallows has p = 0 and wastes its row; a session whose tokens are fixed emits the
                # same whatever it is offered (verification.py, 5 and 6), a sampled one keeps its chain whole (1).
                state = session_guide(session, item.sampling.guide, self.loaded.guides)
                keep = state.allows(session.token_ids[item.sampling.output_start :], chain)
                chain, proposals, confidences = chain[:keep], proposals[:keep], confidences[:keep]
            if chain:
                parents = list(range(-1, len(chain) - 1))
                item = replace(item, tree_tokens=chain, tree_parents=parents, proposals=proposals, lookup_confidences=confidences)
                out[at] = (idx, item, session)
        return out

    def _forced(self, live: list, asking: list[int], results: list) -> list:
        """The pass's sessions, each of `asking` whose guide forces what comes next (`GuideState.forced`: a JSON
        schema's keys and punctuation, the rest of a choice) given those tokens as its tree, a chain of point masses,
        within the model's context and the call's `max_tokens` with the token the pass emits after them, and as deep as
        such drafts have been accepted often enough to pay for their rows (`ForcedAcceptance`: a target may tokenize
        forced text otherwise; where only one token is allowed, its guided p is a point mass on it). Verification
        decides as for any draft: a pass emits the accepted ones together, where plain passes emit one each."""
        out, needed = list(live), self.lookup.needed(len(live))
        for at in asking:
            idx, item, session = live[at]
            if item.sampling.guide is None:
                continue
            room = min(self.loaded.max_context - len(session.token_ids), _left(item, results[idx]), MAX_FORCED + 1) - 1
            most = self.lookup.forced.worth(room, needed) if room > 0 else 0
            if not most:
                continue
            state = session_guide(session, item.sampling.guide, self.loaded.guides)
            chain = state.forced(session.token_ids[item.sampling.output_start :], most, self.loaded.tokenizer)
            if chain:
                point_masses = [([token], [1.0]) for token in chain]
                item = replace(item, tree_tokens=chain, tree_parents=list(range(-1, len(chain) - 1)), proposals=point_masses, forced=True)
                out[at] = (idx, item, session)
        return out

    @staticmethod
    def _step(more: list, results: list[VerifyResult], stepped: list[VerifyResult]) -> None:
        """One plain step's results appended to each session's results of the call."""
        for (idx, _, _), result in zip(more, stepped):
            done = results[idx]
            done.token_ids.extend(result.token_ids)
            done.logprobs.extend(result.logprobs)
            done.top_token_ids.extend(result.top_token_ids)
            done.top_logprobs.extend(result.top_logprobs)
            done.lookup_proposed += result.lookup_proposed
            done.lookup_accepted += result.lookup_accepted
            done.steps += 1

    def _join_last(self, more: list, results: list[VerifyResult]) -> set[str]:
        """The batch's last step, with the waiting calls that need one pass (`join_running`: the batch queue's) in it: their
        sessions verified in the same pass as the steps, each exactly as in a batch of its own, so that they do not
        wait for a pass of their own after the step and the running call's next call does not wait behind that pass.
        Without such calls, no step: the running call ends after the pass under way. Returns the joined sessions."""
        stepping = {item.session_id for _, item, _ in more}

        def one_pass(items: list[VerifyItem]) -> bool:
            return all(item.plain_steps == 1 and item.session_id not in stepping for item in items)

        joined = self.join_running(one_pass, self.max_batch_items - len(more))
        if not joined:
            return set()
        calls = []
        for call in joined:
            answers: list[VerifyResult | None] = [None] * len(call.items)
            calls.append((call, answers, self._synced(call.items, answers)))
        mine = [(("step", idx), item, session) for idx, item, session in more]
        theirs = [((n, idx), item, session) for n, (_, _, live) in enumerate(calls) for idx, item, session in live]
        verified = self._verify(mine + theirs)
        self._step(more, results, verified[: len(mine)])
        for ((n, idx), _, _), result in zip(theirs, verified[len(mine) :]):
            calls[n][1][idx] = result
        # Each joined call's share of the pass is its rows' (its new tokens and tree; a step's token and lookup chain):
        # a prompt prefilled beside a few one-token steps is most of the pass, not the running call's steps' cost.
        rows = [sum(max(1, len(item.new_token_ids)) + len(item.tree_tokens) for _, item, _ in live) for _, _, live in calls]
        total = sum(1 + len(item.tree_tokens) for _, item, _ in mine) + sum(rows)
        for (call, answers, _), fed in zip(calls, rows):
            self.answer(call, answers, len(mine) + len(theirs), fed / max(1, total))
        return {item.session_id for call in joined for item in call.items}

    def _chunk(self, live: list, results: list) -> list:
        """Chunked prefill: the sessions to verify in this batch, within `max_prefill_tokens` of prefill.

        A session whose context still needs more prefill (after the prefix cache) than the budget has left
        is prefilled that far and answered `prefilling`, to be verified in a later batch; sessions that need
        none (decoding) are never held back, so a long prompt does not stall the others for its whole prefill.
        """
        if self.max_prefill_tokens <= 0:
            return live
        needs = []
        for _, _, session in live:
            end = len(session.token_ids) - 1
            session.crop_kv(end)
            if session.prompt_logprobs is None:
                session.reuse_prefix(self.loaded.pool, end)
            needs.append(end - session.kv_len)
        shares = prefill_shares(needs, self.max_prefill_tokens)
        ready, todo = [], []
        for (idx, item, session), need, share in zip(live, needs, shares):
            if share:
                todo.append((session, session.kv_len + share))
            if share == need:
                ready.append((idx, item, session))
            else:
                results[idx] = VerifyResult(item.session_id, known=True, prefilling=True, cached_tokens=session.cached_tokens or 0)
        # Prefilled here, each looked up in the prefix cache once above (a second lookup would count its queries twice).
        prefill(self.loaded, [s for s, _ in todo], ends=[end for _, end in todo], reuse=False)
        return ready

    def _verify(self, live) -> list[VerifyResult]:
        sessions = [session for _, _, session in live]
        prefill(self.loaded, sessions, keep_last=1)
        started = time.perf_counter()
        scored = tree_pass(self.loaded, [(session, item.tree_tokens, item.tree_parents) for _, item, session in live])
        params = [item.sampling for _, item, _ in live]
        # [B, 1 + N, V] on the model's device; p is that of the biased logits, logprobs those of the raw ones.
        raw = scored.logits
        contexts = [
            (session.token_ids, shaping.tree_paths(item.tree_tokens, item.tree_parents)) if item.sampling.reads_context else None
            for _, item, session in live
        ]
        guides = [session_guide(session, item.sampling.guide, self.loaded.guides) for _, item, session in live]
        logits = shaping.adjusted(params, raw, contexts, guides=guides)

        # Greedy and raced sessions have a fixed target token at every row: the greedy walk
        # decides them (obligations 5 and 6); the rest take rejection sampling.
        fixed = [b for b, p in enumerate(params) if p.greedy or p.raced]
        sampled = [b for b, p in enumerate(params) if not (p.greedy or p.raced)]
        accepted, next_token = [None] * len(live), [0] * len(live)
        if fixed:
            # Row 0 fills position len(tokens); the row after a node at depth d fills len(tokens) + d.
            filled = [[len(live[b][2].token_ids) + d for d in [0, *scored.depths[b]]] for b in fixed]
            wanted = shaping.target_tokens([params[b] for b in fixed], logits if not sampled else logits[fixed], filled)
            items = [live[b][1] for b in fixed]
            verdicts = verify_trees_greedy(wanted.tolist(), [item.tree_tokens for item in items], [item.tree_parents for item in items])
            for b, (path, token) in zip(fixed, verdicts):
                accepted[b], next_token[b] = path, token
        if sampled:
            # Rejection sampling: p shaped as each session asked, with its seeded noise.
            rows = [params[b] for b in sampled]
            target_probs = shaping.shape(rows, logits[sampled])
            uniforms, final = shaping.verify_noise(rows, [len(live[b][2].token_ids) for b in sampled], logits.shape[1])
            items = [live[b][1] for b in sampled]
            tokens, parents = [item.tree_tokens for item in items], [item.tree_parents for item in items]
            verdicts = verify_trees(target_probs, tokens, parents, [item.proposals for item in items], uniforms, final)
            for b, (path, token) in zip(sampled, verdicts):
                accepted[b], next_token[b] = path, token
        results = []
        for b, (_, item, session) in enumerate(live):
            path = accepted[b]
            rows = [0] + [node + 1 for node in path]  # the row whose distribution each emitted token was drawn from
            session.commit(rows)
            tokens = [item.tree_tokens[node] for node in path] + [next_token[b]]
            result = VerifyResult(item.session_id, True, accepted_nodes=path, token_ids=tokens, steps=1, cached_tokens=session.cached_tokens or 0)
            if session.prompt_logprobs is not None and session.prompt_logprobs.complete(len(session.token_ids)):
                result.prompt, session.prompt_logprobs = session.prompt_logprobs, None
            session.token_ids.extend(tokens)
            if item.lookup_confidences or item.forced:
                # The tree was the verifier's own (lookup, or forced by the guide): no client's to learn from.
                result.accepted_nodes = []
                result.lookup_proposed = len(item.tree_tokens)
                result.lookup_accepted = len(path)
            if item.lookup_confidences:
                self.lookup.acceptance.observe(item.lookup_confidences, len(path))
            if item.forced:
                self.lookup.forced.observe(len(item.tree_tokens), len(path))
            if item.logprobs:
                result.logprobs, result.top_token_ids, result.top_logprobs = shaping.token_logprobs(raw[b, rows], tokens, item.top_logprobs)
            results.append(result)
        rows = sum(1 + len(item.tree_tokens) for _, item, _ in live)
        looked_up = any(item.lookup_confidences for _, item, _ in live)
        accepted = sum(r.lookup_accepted for r in results) if looked_up else None
        self.lookup.observe_pass(len(live), rows, (time.perf_counter() - started) * 1e3, accepted)
        return results
