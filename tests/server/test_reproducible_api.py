"""Issue 53 through `carpool serve` on its defaults: the same seeded (or greedy) chat request sent three times one
after another on an idle server gets the same answer, though the first computes its whole prompt and the others
find most of it in the prefix cache (the issue's report: "Themed, Phrase, Tutti, Amin" the first time, "Themed,
evidence woven coherent within intricate fallacy," the next two)."""

import uuid

import pytest


@pytest.mark.parametrize("sampling", [{"seed": 11, "temperature": 1.0}, {"temperature": 0}], ids=["seeded", "greedy"])
def test_the_same_request_three_times_gets_the_same_answer(server, sampling):
    client = server.client()
    model = client.models.list().data[0].id
    # a prompt no earlier test sent, so that the first request finds nothing cached
    system = f"Ticket {uuid.uuid4().hex[:8]}. You are a playful lexicographer."
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Invent four words for a colour nobody has seen."},
    ]
    replies = []
    for _ in range(3):
        server.wait_idle()
        replies.append(client.chat.completions.create(model=model, messages=messages, max_tokens=24, **sampling))
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    assert cached[1] == cached[2] >= cached[0] + 16, cached  # the first computed more of its prompt than the others
    assert len({r.choices[0].message.content for r in replies}) == 1, [r.choices[0].message.content for r in replies]
