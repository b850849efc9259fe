"""Synthetic AMI-like meetings: four roles design a remote control over four meetings.

Each dialogue proposes, rejects and decides a few design slots. The summary reports the decisions, so it is
learnable from the transcript. Deterministic by seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

_ROLES = ("project manager", "industrial designer", "marketing expert", "user interface designer")
_NAMES = tuple(
    "Craig Andrew Laura Sarah David Marco Ines Tom Agnes Ruth "
    "Kim Pieter Nadia Oscar Helen Jasper Mia Rafael Yvonne Bram".split()
)
_PHASES = {
    "kick-off": ("target", "feature", "colour"),
    "functional design": ("interface", "target", "feature"),
    "conceptual design": ("energy", "material", "shape", "interface"),
    "detailed design": ("shape", "colour", "material", "price"),
}
_OPTIONS = {
    "energy": ("a standard battery", "kinetic energy", "solar cells", "a rechargeable battery in a docking station"),
    "material": ("hard plastic", "soft rubber", "titanium", "wood", "a spongy latex cover"),
    "shape": ("a curved case", "a flat case", "a double-curved case", "a banana shape", "an egg shape"),
    "interface": ("push buttons", "a scroll wheel", "an LCD screen", "a joystick", "voice recognition"),
    "colour": ("yellow", "black and grey", "the company colours", "bright blue", "fruity green"),
    "target": (
        "young people aged fifteen to thirty-five",
        "elderly users",
        "families with children",
        "trend-conscious buyers",
    ),
    "feature": (
        "a locator beep to find a lost remote",
        "backlit buttons",
        "a big teletext button",
        "interchangeable front covers",
        "a child lock",
    ),
}
_TOPICS = {
    "energy": "the energy source",
    "material": "the case material",
    "shape": "the shape",
    "interface": "the interface",
    "colour": "the colour",
    "target": "the target group",
    "feature": "extra features",
    "price": "the production cost",
}
# slot -> (proposals, objections to the alternative, decisions)
_TALK = {
    "energy": (
        ("For the power we could use {alt} or {value}.", "The energy options are {alt} and {value}, um."),
        ("I think {alt} is too expensive for our budget.", "Uh {alt} is not reliable enough, I'd say."),
        ("Okay, so we go for {value} as the energy source.", "So we agree on {value} for the power then."),
    ),
    "material": (
        ("The case could be made of {value}, or {alt}.", "Manufacturing gave us {alt} and {value}."),
        ("{alt} would break too easily, I'm afraid.", "Hmm, {alt} feels cheap in the hand."),
        ("Right, the case will be {value}.", "Fine, let's take {value} for the case."),
    ),
    "shape": (
        ("I sketched {value} here on the board.", "We could do {alt}, or {value} maybe."),
        ("{alt} is boring, every remote looks like that.", "With {alt} it won't fit in the hand."),
        ("Okay, {value} it is.", "So we agree on {value}, yeah."),
    ),
    "interface": (
        ("For the interface I looked at {value} and {alt}.", "What about {alt}? Or {value}?"),
        ("{alt} is too complicated for most users.", "Uh {alt} would need the advanced chip."),
        ("So the main control will be {value}.", "Let's go with {value} then."),
    ),
    "colour": (
        ("The trend watchers say {value} is in this year.", "Should it be {alt} or {value}?"),
        ("{alt} looks dull in the shop.", "Nobody buys {alt} any more, I think."),
        ("Okay, {value} for the colour.", "Alright, {value} it is."),
    ),
    "target": (
        ("Our research points at {value} as buyers.", "Are we aiming at {alt} or at {value}?"),
        ("{alt} don't buy separate remotes very often.", "{alt} are a small market for us."),
        ("So our target group is {value}.", "Okay, we design it for {value}."),
    ),
    "feature": (
        ("Users asked for {value}.", "We could add {alt}, or {value}."),
        ("{alt} would push the price up too much.", "Um {alt} nobody really needs."),
        ("Let's include {value}.", "Okay, {value} goes in."),
    ),
    "price": (
        ("So the components add up to {value}.", "I did the calculation, it comes to {value}."),
        ("We can't go above twelve fifty Euros per unit.", "The budget was twelve fifty, remember."),
        ("Okay, so we end up at {value}.", "Right, {value} then."),
    ),
}
_SUMMARY = {
    "energy": (
        "The group chose {value} as the energy source and rejected {alt} as too costly or unreliable.",
        "After comparing {alt} with {value}, the team decided to power the remote with {value}.",
    ),
    "material": (
        "The case will be made of {value}; {alt} was rejected.",
        "The team picked {value} for the case rather than {alt}.",
    ),
    "shape": (
        "The industrial designer proposed {value}, which the group accepted over {alt}.",
        "They agreed on {value} for the design.",
    ),
    "interface": (
        "The user interface designer presented {value} and {alt}; the team chose {value}.",
        "The main control will be {value}, since {alt} was judged too complicated.",
    ),
    "colour": ("The remote will be {value}.", "Following the trend report, the group chose {value} over {alt}."),
    "target": (
        "The marketing expert identified {value} as the target group.",
        "The team decided to aim the product at {value} rather than {alt}.",
    ),
    "feature": ("The group decided to include {value}.", "They added {value} to the design and dropped {alt}."),
    "price": (
        "The project manager calculated a production cost of {value}, {budget} the budget of 12.50 Euros.",
        "The cost evaluation came to {value}, {budget} the budget.",
    ),
}
_CLOSINGS = (
    "The meeting closed with the next tasks for each member.",
    "Each member received a task for the next meeting, and the group agreed to keep in touch by email about "
    "the open questions on the design.",
)
_FILLER = (
    "Mm-hmm.",
    "Yeah.",
    "Okay.",
    "Right.",
    "Um.",
    "Uh-huh.",
    "Yeah, yeah.",
    "Sure.",
    "Alright.",
    "Hmm.",
    "That's true.",
    "I think so, yeah.",
    "Mm.",
    "Oh, okay.",
    "Yep.",
    "Exactly.",
    "Uh I don't know.",
)
_CHATTER = (
    "Can everybody see the slides? Uh, next one please.",
    "I'll send the minutes around after the meeting.",
    "We have about {n} minutes left for this meeting.",
    "People said they often lose the remote in the sofa.",
    "Most users only use about {n} percent of the buttons.",
    "Let me just find the right file, sorry.",
    "The selling price should be twenty five Euros.",
    "Our profit aim is fifty million Euros.",
    "Remote controls are often ugly, according to the survey.",
    "Zapping is what people do most with a remote.",
    "The coach will send us an email with the new requirements.",
    "Uh, the whiteboard pen is not working.",
    "Teletext is becoming less important because of the internet.",
    "It should fit the corporate image.",
    "Young people are willing to pay more for a fancy look.",
    "The chip on the print could be simple or advanced.",
    "I didn't have time to look into that yet, sorry.",
    "Let's get back to the agenda.",
    "So that is more or less what I found on the web.",
    "RSI is a problem for some people, they said.",
    "It should be easy to use without reading a manual.",
    "We could put the logo on the front.",
    "I think we're running a bit out of time.",
    "Does anybody have questions about that?",
    "{name}, could you {task} before the next meeting?",
    "I'll {task} this {day}, no problem.",
    "In the survey, {n} out of a hundred people wanted {thing}.",
    "Last {day} I saw {thing} in a shop in town.",
    "My parents have {n} remotes on their coffee table, it's ridiculous.",
    "We should ask the {role} about {thing}.",
    "So, um, {thing} would cost us roughly {n} cents extra.",
    "Our competitors mostly sell {thing}, I noticed.",
    "Can we leave {thing} for later? We're a bit behind schedule.",
    "I'm not sure the {role} agrees with that.",
    "Maybe {name} knows more about {thing}?",
    "The meeting room is booked until {n} past four.",
    "Sorry, my laptop just crashed, give me a second.",
    "Oh, and the batteries should be easy to replace.",
    "The manufacturing department says the print costs a bit more.",
    "Should we write that down?",
)
_FILL = {
    "task": (
        "check the component prices",
        "draw a first prototype",
        "look at the market report",
        "mail the coach",
        "test the buttons with some users",
        "update the project document",
        "ask the engineers",
    ),
    "day": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "weekend", "morning", "afternoon"),
    "thing": (
        "voice control",
        "a docking station",
        "rubber buttons",
        "a fruit theme",
        "a small screen",
        "a universal remote",
        "a glow in the dark case",
        "a spinning wheel",
        "a clip for the belt",
    ),
}


def _slot_values(slot: str, rng: random.Random) -> dict[str, str]:
    if slot == "price":
        cost = rng.choice((10.5, 11.2, 11.9, 12.3, 12.5, 13.1, 13.8, 14.6))
        return {"value": f"{cost:.2f} Euros", "alt": "12.50 Euros", "budget": "within" if cost <= 12.5 else "above"}
    value, alt = rng.sample(_OPTIONS[slot], 2)
    return {"value": value, "alt": alt}


def _sentence(template: str, slots: dict[str, str]) -> str:
    text = template.format(**slots)
    return text[0].upper() + text[1:]


def _chatter(rng: random.Random, names: Sequence[str]) -> str:
    fill = {key: rng.choice(options) for key, options in _FILL.items()}
    fill.update(name=rng.choice(names), role=rng.choice(_ROLES), n=str(rng.randint(2, 60)))
    return rng.choice(_CHATTER).format(**fill)


def _meeting(index: int, seed: int, rng: random.Random) -> dict[str, str]:
    phase = rng.choice(tuple(_PHASES))
    slots = list(_PHASES[phase])
    chosen = rng.sample(slots, rng.randint(2, len(slots)))
    names = rng.sample(_NAMES, 4)
    values = {slot: _slot_values(slot, rng) for slot in chosen}
    turns: list[str] = [f"Okay, let's start. This is our {phase} meeting."]
    if phase == "kick-off":
        turns += [f"Hi, I'm {n} and I'm the {r}." for n, r in zip(names, _ROLES, strict=True)]
    for slot in chosen:
        proposals, objections, decisions = _TALK[slot]
        talk = [rng.choice(proposals), rng.choice(_FILLER), rng.choice(objections), rng.choice(decisions)]
        turns += [_sentence(t, values[slot]) for t in talk]
    # A recap near the end: the end of a transcript survives truncation, so the decisions stay visible.
    recap = "; ".join(f"{_TOPICS[slot]}: {values[slot]['value']}" for slot in chosen)
    closing = f"So, to sum up. {recap[0].upper() + recap[1:]}. Okay, that's it for today, thanks everybody."
    words, target_words = sum(len(t.split()) for t in turns), rng.randint(250, 1400)
    while words < target_words:  # pad with filler and chatter at random places
        line = rng.choice(_FILLER) if rng.random() < 0.4 else _chatter(rng, names)
        turns.insert(rng.randint(1, len(turns)), line)
        words += len(line.split())
    turns.append(closing)
    paragraphs, start = [], 0
    while start < len(turns):
        step = rng.randint(3, 9)
        paragraphs.append(" ".join(turns[start : start + step]))
        start += step
    topics = " and ".join(", ".join(_TOPICS[slot] for slot in chosen).rsplit(", ", 1))
    summary = [f"In the {phase} meeting, chaired by the project manager {names[0]}, the team discussed {topics}."]
    summary += [_sentence(rng.choice(_SUMMARY[slot]), values[slot]) for slot in chosen]
    summary.append(rng.choice(_CLOSINGS))
    return {"id": f"synthetic-{seed}-{index:05d}", "dialogue": "\n".join(paragraphs), "summary": " ".join(summary)}


def generate_synthetic_meetings(n: int, seed: int = 0) -> list[dict[str, str]]:
    """AMI-like product-design meetings with summaries of the decisions taken.

    Each meeting settles 2-4 design slots, padded with disfluencies and chatter, without speaker labels, like AMI.

    Args:
        n (int): number of meetings.
        seed (int): the same seed gives the same meetings; the first k of n equal ``n=k``. Default: 0

    Returns:
        list[dict[str, str]]: rows with keys ``id``, ``dialogue``, ``summary``.

    Example:
        >>> rows = generate_synthetic_meetings(8, seed=0)
    """
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0.")
    rng = random.Random(seed)
    return [_meeting(i, seed, rng) for i in range(n)]


def write_mixed_length_meetings(path: str | Path, n: int = 64, seed: int = 1) -> str:
    """A jsonl of ``n`` synthetic meetings with transcripts and summaries cut to random lengths.

    Mixed lengths make micro-batches pad and ranks draw uneven work, as real transcripts do.

    Returns:
        str: ``path``, for ``--source``.
    """
    rng = random.Random(seed)
    rows = generate_synthetic_meetings(n, seed=seed)
    for row in rows:
        row["dialogue"] = " ".join(row["dialogue"].split()[: rng.randint(10, 160)])
        row["summary"] = " ".join(row["summary"].split()[: rng.randint(5, 60)])
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)
