"""Output text for a sequence as tokens arrive: stop strings are found and cut, and text that might still be
the start of a stop string (or half of a UTF-8 character) is held back from the stream until it is settled."""

from carpool.engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def update(self, seq: Sequence) -> bool:
        """Refresh seq.output_text; True when a stop string ended the sequence (the text is cut before it)."""
        text = self.tokenizer.decode(seq.output_token_ids)
        # Like EOS, stop strings end nothing before min_tokens (vLLM's rule); text from then on is searched.
        stops = seq.params.stop_strings if seq.num_output_tokens >= seq.params.min_tokens else []
        if stops:
            longest = max(map(len, stops))
            search_from = max(0, len(seq.output_text) - longest)
            found = [i for i in (text.find(s, search_from) for s in stops) if i != -1]
            if found:
                seq.output_text = text[: min(found)]
                return True
        seq.output_text = text
        return False

    @staticmethod
    def settled_length(seq: Sequence) -> int:
        """How much of seq.output_text can be streamed now without risk of taking it back."""
        text = seq.output_text
        if seq.is_finished:
            return len(text)
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        held = max(
            (
                k
                for stop in seq.params.stop_strings
                for k in range(1, min(len(stop) - 1, end) + 1)
                if text[end - k : end] == stop[:k]
            ),
            default=0,
        )
        return end - held
