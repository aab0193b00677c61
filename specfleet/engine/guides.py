"""The tokens a guide (specfleet/guides.py) allows at each row of a pass, for one session.

`GuideState` is a session's grammar matcher after its output so far. Each pass it catches up with the session's
output (rolling back what the router rolled back), then walks each row's path (the tree's tokens from the root to the
row's node), reads the allowed tokens there and rolls the path back: row r's mask is the grammar's after the output and
paths[r], as the row's logits are the model's after them. A row whose path leaves the grammar (a draft token it does
not allow, which the verification then rejects with p = 0) or follows a completed one is left unmasked: no emitted
token is drawn from it. Once the output itself has left the grammar (past end of sequence, where a request ignores it),
nothing is masked.

A reasoning model's thought (`Guide.thought_end`) is left alone: the grammar reads what follows the first end of the
thought, and a row inside the thought (its output and path not past that end) is unmasked. Where the output may open a
thought (`Guide.thought_open`), its first row allows that token beside the grammar's.
"""

from __future__ import annotations

import torch

from specfleet.engine import cpu_kernels
from specfleet.guides import Guide, GuideCompiler


class GuideState:
    """One session's matcher under one guide, and the output tokens it has accepted."""

    def __init__(self, guide: Guide, compiled, vocab_size: int):
        import xgrammar

        self.guide, self.vocab_size = guide, vocab_size
        self._xgr = xgrammar
        self._compiled = compiled
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._accepted: list[int] = []
        self._left = False  # the accepted output left the grammar: nothing is masked
        self._bitmask = torch.empty((0, 0), dtype=torch.int32)

    def _sync(self, output: list[int]) -> None:
        """Catch the matcher up with `output`: roll back past the first token that differs, accept the rest."""
        same = len(self._accepted)
        if output[:same] != self._accepted:  # rolled back: keep what the two share
            parted = (i for i, (mine, theirs) in enumerate(zip(self._accepted, output)) if mine != theirs)
            same = next(parted, min(len(self._accepted), len(output)))
        back = len(self._accepted) - same
        if back and self._left:
            self._matcher, self._accepted, self._left, same = self._xgr.GrammarMatcher(self._compiled), [], False, 0
        elif back:
            self._matcher.rollback(back)
            del self._accepted[same:]
        for token in output[same:]:
            if not self._left and not self._matcher.accept_token(token):
                self._left = True
            self._accepted.append(token)

    def _guided(self, output: list[int], paths: list[list[int]]) -> tuple[list[int] | None, list[list[int] | None], bool]:
        """What the grammar reads: the output's part past its thought (None: the output is inside one), each row's
        path past the thought (None: the row is inside it), and whether the output may still open a thought."""
        end, opens = self.guide.thought_end, self.guide.thought_open
        if not end:
            return output, paths, False
        if opens is not None and not output:
            return [], [path if path[:1] != [opens] else _past(path, end, 1) for path in paths], True
        thought = 0 if opens is None else 1 if output[0] == opens else None  # where the output's thought starts
        if thought is None:
            return output, paths, False
        start = _end(output, end, thought)
        if start is not None:
            return output[start:], paths, False
        # The output's last tokens may begin an end that a path completes: what follows it is all the path's.
        tail = output[max(thought, len(output) - len(end) + 1) :]
        return None, [_past(tail + path, end, 0) for path in paths], False

    def bitmask(self, output: list[int], paths: list[list[int]]) -> torch.Tensor | None:
        """The tokens the guide allows at row r, after `output` (the session's output so far) then paths[r], as
        xgrammar's bitmask: int32 [len(paths), ceil(vocab_size / 32)] on the CPU (rows reused by the next call), bit j
        of word w set where token 32 w + j is allowed; a row no emitted token can come from, or inside a thought,
        allows every token. None: nothing masked."""
        base, rows, may_open = self._guided(output, paths)
        self._sync(base if base is not None else [])
        if self._left or self._matcher.is_terminated() or all(row is None for row in rows):
            return None
        bitmask = self._rows(len(paths))
        walked: list[int] = []  # the tokens past the output the matcher holds: rows share their paths' prefixes
        for r, path in enumerate(rows):
            if path is None:
                bitmask[r] = -1  # inside the thought
                continue
            shared = 0
            while shared < min(len(walked), len(path)) and walked[shared] == path[shared]:
                shared += 1
            if len(walked) > shared:
                self._matcher.rollback(len(walked) - shared)
                del walked[shared:]
            walked += path[shared : shared + self._walk(path[shared:])]
            if len(walked) == len(path) and not self._matcher.is_terminated():
                self._matcher.fill_next_token_bitmask(bitmask, r)
            else:
                bitmask[r] = -1  # a path the grammar disallows, or past its end: no emitted token comes from it
        if walked:
            self._matcher.rollback(len(walked))
        if may_open:  # the first row may open the thought instead
            bit = self.guide.thought_open % 32
            bitmask[0, self.guide.thought_open // 32] |= (1 << bit) if bit < 31 else -(1 << 31)
        return bitmask

    def _rows(self, n: int) -> torch.Tensor:
        """n rows of the bitmask kept from pass to pass (each use writes every row it reads)."""
        if len(self._bitmask) < n:
            self._bitmask = torch.empty((n, (self.vocab_size + 31) // 32), dtype=torch.int32)
        return self._bitmask[:n]

    def allows(self, output: list[int], tokens: list[int]) -> int:
        """How many of `tokens`, after `output`, the guide allows in a row (all of them where the output has left
        the grammar)."""
        base, _, may_open = self._guided(output, [])
        if base is None or may_open:
            return len(tokens)  # inside a thought, or where one may open: the grammar has not begun
        self._sync(base)
        if self._left:
            return len(tokens)
        walked = self._walk(tokens)
        if walked:
            self._matcher.rollback(walked)
        return walked

    def _walk(self, tokens: list[int]) -> int:
        """Feed the matcher `tokens` up to the first the grammar disallows (or past its end): how many it took."""
        for n, token in enumerate(tokens):
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                return n
        return len(tokens)

    def forced(self, output: list[int], most: int, tokenizer) -> list[int]:
        """Draft tokens for what the guide forces after `output` (the session's output so far), up to `most`: the text
        it forces next (xgrammar's jump-forward string: a JSON schema's keys and punctuation, the rest of the one
        choice left) as `tokenizer` encodes it, then while exactly one token is allowed (end of sequence once the
        grammar is complete), that token. A tokenization the grammar allows but the target would not choose is only
        a draft the verification rejects; [] where the next token is the model's choice (inside a thought, say)."""
        base, _, may_open = self._guided(output, [])
        if base is None or may_open:
            return []
        self._sync(base)
        if self._left or self._matcher.is_terminated():
            return []
        text = self._matcher.find_jump_forward_string()
        encoded = tokenizer.encode(text, add_special_tokens=False)[:most] if text else []
        chain = encoded[: self._walk(encoded)]
        one = self._rows(1)
        while len(chain) < most and not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(one, 0)
            words = one[0].nonzero()
            word = int(one[0, words[0, 0]]) & 0xFFFFFFFF if len(words) == 1 else 0
            if not word or word & (word - 1) or not self._matcher.accept_token(token := 32 * int(words[0, 0]) + word.bit_length() - 1):
                break  # a choice of tokens (or none): the model's
            chain.append(token)
        if chain:
            self._matcher.rollback(len(chain))
        return chain


def _end(tokens: list[int], end: tuple[int, ...], start: int) -> int | None:
    """The index just past the first `end` in tokens[start:], or None."""
    at = start
    while True:
        try:
            at = tokens.index(end[0], at)
        except ValueError:
            return None
        if tuple(tokens[at : at + len(end)]) == end:
            return at + len(end)
        at += 1


def _past(tokens: list[int], end: tuple[int, ...], start: int) -> list[int] | None:
    """What follows the first `end` in tokens[start:], or None where there is none."""
    past = _end(tokens, end, start)
    return None if past is None else tokens[past:]


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab_size] bool from xgrammar's bitmask [R, words] (on its device)."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.reshape(len(bitmask), -1)[:, :vocab_size].bool()


def mask_rows(rows: torch.Tensor, bitmask: torch.Tensor, ids_of: torch.Tensor | None) -> None:
    """Every token the bitmask disallows given no chance (logit -inf) in place, at rows [R, V'] (ids_of[j]: position j's
    vocabulary id; None: position j is id j). Float32 rows on the CPU take csrc/bitmask.cpp's loop, which reads the
    bits in place; others unpack them."""
    if ids_of is None and rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.is_contiguous() and cpu_kernels.library():
        cpu_kernels.mask_bits(rows, bitmask)
        return
    allowed = unpack(bitmask.to(rows.device), rows.shape[-1] if ids_of is None else int(ids_of.max()) + 1)
    allowed = allowed if ids_of is None else allowed[:, ids_of.to(rows.device)]
    rows.masked_fill_(~allowed, float("-inf"))


# Bit j of a bitmask word.
_SHIFTS = torch.arange(32, dtype=torch.int32)


def session_guide(session, guide: Guide | None, compiler: GuideCompiler) -> GuideState | None:
    """The session's GuideState for `guide` (kept on the session as `guide_state`), made on its first guided pass."""
    if guide is None:
        return None
    state = session.guide_state
    if state is None or state.guide != guide:
        state = GuideState(guide, compiler.compile(guide), compiler.vocab_size)
        session.guide_state = state
    return state
