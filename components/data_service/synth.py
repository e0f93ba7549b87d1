"""`gemrec data synth`: a seeded synthetic event log with production-like shape and planted signals.

Shape: heavy-tailed (lognormal) history lengths clipped at `max_length` (16k by default), Zipf item
popularity over a catalog whose raw ids come from a 2^62 space (item ids hashed into `item_hash_buckets`),
sessions of closely spaced events, many sparse features (user, item, context; multi-valued interests and
tags) and dense features. Everything is vectorized numpy; the same seed gives byte-identical output.

Planted signals (docs/data.md has the full recipe), strongest first:
- recent interest (sequence only): each user's current interest category drifts in phases (about
  `phase_length` events each). Events in the current category get liked more often. The click logit gets
  +`recent_weight` * decay^(lag-1) when an event among the last `window` events (strictly earlier in time)
  was liked and has the target's category. Only a model that reads the history's item features and
  actions can see this; the user id cannot, because the phases drift.
- saturation (sequence only): -`repeat_weight` on the click logit when the target item itself is among
  the last `window` events.
- repeat purchase (sequence only): conversion given click is likelier when the same item was clicked
  within the last `window` events.
- static (any model): item quality, price, user interests (a multi-valued user feature) matching the item
  category, device and surface effects, position bias.
The manifest records the generator config and the NE of the true probabilities on the eval split (the
best NE any model can reach), next to the NE of the true static terms alone (intercept refitted): a
reference for what a history-blind model gets.

Profiles: "full" (every feature below, every event an example), "h200-bench", the shape of the trainer's
GPU benchmark (`gpu_bench`, recipe `h200-bench` `[bench]`): its sparse features with their table sizes,
`item_category` and `item_brand` on history tokens, 16 dense features, and one example per user (its last
event, `SplitConfig(by="last_event")`) whose history length is lognormal with mean `mean_length` and sigma
`length_sigma`, capped at `max_length`, as the benchmark draws them; and "h200-long", the same at recipe
`h200-long`'s history lengths (up to 16,384 events).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .builder import TIME_FEATURES, Categorical, EventLog, SideTable, SplitConfig, build_dataset
from .errors import DataError


@dataclass
class SynthConfig:
    events: int = 1_000_000
    seed: int = 0
    mean_length: float = 200.0  # mean events per user (lognormal)
    length_sigma: float = 1.5  # lognormal sigma of lengths: the tail
    max_length: int = 16_384
    items: int = 200_000  # catalog size
    item_hash_buckets: int | None = 131_072  # item_id embedding rows (hashed when the catalog is bigger)
    zipf: float = 1.05  # item popularity exponent
    categories: int = 300
    brands: int = 5_000
    tags: int = 2_000
    days: float = 180.0  # time window of the log
    start: int = 1_700_000_000  # unix seconds of the window start
    phase_length: float = 25.0  # mean events per interest phase
    window: int = 8  # planted-signal look-back (events)
    decay: float = 0.8
    recent_weight: float = 2.5
    repeat_weight: float = 1.2
    segments: int = 1_000  # user_segment values
    surfaces: int = 8  # ctx_surface table rows (the generator uses the first 8)
    positions: int = 20  # ctx_position table rows (slots 0..positions-1)
    profile: str = "full"  # "full" | "h200-bench" | "h200-long" (module docstring)

    @classmethod
    def for_profile(cls, profile: str, **overrides) -> SynthConfig:
        """The profile's defaults, then `overrides`."""
        if profile not in PROFILES:
            raise DataError(f"synth: unknown profile {profile!r}; choose {', '.join(PROFILES)}")
        return cls(**{**PROFILES[profile], "profile": profile, **overrides})

    def validate(self) -> None:
        if self.profile not in PROFILES:
            raise DataError(f"synth: unknown profile {self.profile!r}; choose {', '.join(PROFILES)}")
        if self.surfaces < len(SURFACES) or self.positions < 1 or self.segments < 1:
            raise DataError(f"synth: surfaces >= {len(SURFACES)}, positions >= 1 and segments >= 1 are required")
        if self.events < 1 or self.items < 1 or self.categories < 1 or self.max_length < 1:
            raise DataError("synth: events, items, categories and max_length must be positive")
        if self.mean_length < 1 or self.length_sigma < 0 or self.zipf <= 0:
            raise DataError("synth: mean_length >= 1, length_sigma >= 0 and zipf > 0 are required")
        if self.item_hash_buckets is not None and self.item_hash_buckets < 1:
            raise DataError("synth: item_hash_buckets must be positive")


# The trainer's GPU benchmark shape (gpu_bench.synthetic_schema with recipe h200-bench's [bench]); `mean_length`
# is the mean history length of the one example per user.
PROFILES = {
    "full": {},
    "h200-bench": dict(
        events=4_000_000,
        mean_length=384.0,
        length_sigma=0.8,
        max_length=1024,
        items=1_000_000,
        item_hash_buckets=None,
        categories=1_000,
        brands=50_000,
        tags=20_000,
        segments=10_000,
        surfaces=16,
        positions=64,
    ),
}
# recipe h200-long's [bench]: the same schema, histories up to 16,384 events averaging ~4,100 after the cap
PROFILES["h200-long"] = {**PROFILES["h200-bench"], "events": 8_000_000, "mean_length": 4250.0, "max_length": 16384}
BENCH_PROFILES = ("h200-bench", "h200-long")
BENCH_SEQ_FEATURES = ["item_category", "item_brand"]
BENCH_DENSE = 16  # the benchmark's dense features: the time ones, user_tenure, item_quality, item_price, noise

DEVICES = ["ios", "android", "web", "tv"]
SURFACES = ["feed", "search", "related", "notification", "profile", "story", "reel", "shop"]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _unique_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """n distinct random raw ids from [0, 2^62), in random order."""
    ids = np.unique(rng.integers(0, 2**62, size=n + n // 100 + 16, dtype=np.int64))
    while len(ids) < n:
        ids = np.unique(np.concatenate([ids, rng.integers(0, 2**62, size=n, dtype=np.int64)]))
    return rng.permutation(ids[:n])


def _lengths(rng: np.random.Generator, cfg: SynthConfig) -> np.ndarray:
    """Per-user event counts summing to exactly cfg.events (bench profiles: 1 + the last event's history length)."""
    mu = np.log(cfg.mean_length) - cfg.length_sigma**2 / 2
    extra = 1 if cfg.profile in BENCH_PROFILES else 0
    lengths = np.zeros(0, dtype=np.int64)
    while lengths.sum() < cfg.events:
        draw = rng.lognormal(mu, cfg.length_sigma, size=int(cfg.events / cfg.mean_length * 1.3) + 16)
        lengths = np.concatenate([lengths, np.clip(np.round(draw), 1, cfg.max_length).astype(np.int64) + extra])
    total = np.cumsum(lengths)
    num_users = int(np.searchsorted(total, cfg.events)) + 1
    lengths = lengths[:num_users].copy()
    lengths[-1] -= int(total[num_users - 1]) - cfg.events
    return lengths


def _pick(rng: np.random.Generator, cumulative: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Index i with probability proportional to weight i, restricted to cumulative range [low, high)."""
    u = low + rng.random(len(low)) * (high - low)
    return np.minimum(np.searchsorted(cumulative, u, side="right"), len(cumulative) - 1)


def _mean_log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def _ne(p: np.ndarray, y: np.ndarray) -> float | None:
    rate = float(y.mean()) if len(y) else 0.0
    if rate <= 0.0 or rate >= 1.0:
        return None
    return round(_mean_log_loss(p, y) / _mean_log_loss(np.full(len(y), rate), y), 5)


def generate(
    cfg: SynthConfig, split: SplitConfig | None = None, progress: bool = True
) -> tuple[EventLog, SideTable, SideTable, dict]:
    """The event log, item and user side tables, and the planted-signal report."""
    cfg.validate()
    rng = np.random.default_rng(cfg.seed)
    steps = tqdm(total=5, desc="synth", unit="step", disable=not progress, leave=False)

    # Items: Zipf popularity over a random ranking; categories of Zipf-like sizes.
    steps.set_postfix_str("items")
    item_raw = _unique_ids(rng, cfg.items)
    category_weight = 1.0 / np.arange(1, cfg.categories + 1) ** 0.8
    item_category = rng.choice(cfg.categories, size=cfg.items, p=category_weight / category_weight.sum())
    popularity = 1.0 / (rng.permutation(cfg.items) + 1.0) ** cfg.zipf
    item_brand = (item_category * 17 + rng.integers(0, 40, cfg.items)) % cfg.brands
    tag_counts = rng.integers(0, 5, cfg.items)
    tag_offsets = np.zeros(cfg.items + 1, dtype=np.int64)
    np.cumsum(tag_counts, out=tag_offsets[1:])
    item_tags = rng.integers(0, cfg.tags, tag_offsets[-1])
    item_quality = rng.normal(0.0, 1.0, cfg.items)
    price_log = rng.normal(3.0 + (item_category % 7) * 0.2, 1.0)
    item_price = (price_log - price_log.mean()) / price_log.std()
    # Cumulative popularity, globally and within each category (items grouped by category).
    global_cum = np.cumsum(popularity)
    by_category = np.argsort(item_category, kind="stable")
    category_cum = np.cumsum(popularity[by_category])
    category_end = np.searchsorted(item_category[by_category], np.arange(cfg.categories), side="right")
    category_begin = np.concatenate([[0], category_end[:-1]])
    existing = np.flatnonzero(category_end > category_begin)
    existing_weight = np.bincount(item_category, minlength=cfg.categories)[existing].astype(np.float64)
    steps.update()

    # Users: lengths, demographics, static interests (1-4 categories).
    steps.set_postfix_str("users")
    lengths = _lengths(rng, cfg)
    num_users = len(lengths)
    user_raw = _unique_ids(rng, num_users)
    country_weight = 1.0 / np.arange(1, 201) ** 1.2
    user_country = rng.choice(200, size=num_users, p=country_weight / country_weight.sum())
    user_age = rng.integers(0, 8, num_users)
    user_gender = rng.integers(0, 3, num_users)
    user_segment = rng.integers(0, cfg.segments, num_users)
    user_tenure = rng.random(num_users).astype(np.float32)
    user_device = rng.integers(0, len(DEVICES), num_users)
    interest_counts = rng.integers(1, 5, num_users)
    interest_offsets = np.zeros(num_users + 1, dtype=np.int64)
    np.cumsum(interest_counts, out=interest_offsets[1:])
    interests = rng.choice(existing, size=interest_offsets[-1], p=existing_weight / existing_weight.sum())
    steps.update()

    # Events: interest phases, item choice, timestamps (sessions), context.
    steps.set_postfix_str("events")
    n = cfg.events
    user = np.repeat(np.arange(num_users), lengths)
    interest_starts = interest_offsets[:-1]
    first = np.zeros(n, dtype=bool)
    user_begin = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    first[user_begin] = True
    position = np.arange(n) - user_begin[user]
    new_phase = first | (rng.random(n) < 1.0 / cfg.phase_length)
    phase_user = user[new_phase]
    from_interests = rng.random(len(phase_user)) < 0.6
    pick = interest_starts[phase_user] + (rng.random(len(phase_user)) * interest_counts[phase_user]).astype(np.int64)
    random_category = rng.choice(existing, size=len(phase_user), p=existing_weight / existing_weight.sum())
    phase_category = np.where(from_interests, interests[pick], random_category)[np.cumsum(new_phase) - 1]
    in_phase = rng.random(n) < 0.7
    item = by_category[
        _pick(
            rng,
            category_cum,
            np.where(category_begin[phase_category] > 0, category_cum[category_begin[phase_category] - 1], 0.0),
            category_cum[category_end[phase_category] - 1],
        )
    ]
    item = np.where(in_phase, item, _pick(rng, global_cum, np.zeros(n), np.full(n, global_cum[-1])))
    category = item_category[item]

    window_seconds = cfg.days * 86_400.0
    span = window_seconds * rng.uniform(0.05, 1.0, num_users)
    gaps = np.where(rng.random(n) < 0.85, rng.exponential(40.0, n), rng.exponential(86_400.0, n))
    gaps[user_begin] = 0.0
    gap_total = np.bincount(user, weights=gaps, minlength=num_users)
    scale = np.minimum(1.0, span / np.maximum(gap_total, 1.0))
    elapsed = np.cumsum(gaps * scale[user])
    elapsed -= elapsed[user_begin][user]
    user_start = cfg.start + rng.random(num_users) * (window_seconds - np.minimum(gap_total * scale, span))
    timestamps = np.floor(user_start[user] + elapsed).astype(np.int64)

    device = np.where(rng.random(n) < 0.7, user_device[user], rng.integers(0, len(DEVICES), n))
    surface = rng.choice(len(SURFACES), size=n, p=np.array([30, 15, 15, 5, 5, 10, 15, 5]) / 100.0)
    slot = np.minimum(rng.geometric(0.25, n) - 1, cfg.positions - 1)
    steps.update()

    # Outcomes: like (interest match), then click (static + sequence terms), then convert.
    steps.set_postfix_str("labels")
    like = rng.random(n) < _sigmoid(-1.0 + 2.5 * (category == phase_category) + 0.7 * item_quality[item])
    recent = np.zeros(n)
    repeat = np.zeros(n, dtype=bool)
    earlier_ok = []
    for lag in range(1, cfg.window + 1):
        prev = np.maximum(np.arange(n) - lag, 0)
        ok = (position >= lag) & (timestamps[prev] < timestamps)
        earlier_ok.append(ok)
        liked_match = ok & like[prev] & (category[prev] == category)
        recent = np.maximum(recent, liked_match * cfg.decay ** (lag - 1))
        repeat |= ok & (item[prev] == item)
    interest_match = np.zeros(n, dtype=bool)
    for j in range(int(interest_counts.max())):
        has = interest_counts[user] > j
        interest_match |= has & (interests[np.minimum(interest_starts[user] + j, len(interests) - 1)] == category)
    device_effect = np.array([0.2, 0.0, -0.2, -0.4])[device]
    surface_effect = np.array([0.0, 0.5, 0.2, -0.5, -0.2, 0.1, 0.3, 0.4])[surface]
    static_logit = -1.6 + 0.6 * item_quality[item] + 0.8 * interest_match + device_effect + surface_effect - 0.08 * slot
    p_click = _sigmoid(static_logit + cfg.recent_weight * recent - cfg.repeat_weight * repeat)
    click = rng.random(n) < p_click
    clicked_same = np.zeros(n, dtype=bool)
    for lag, ok in enumerate(earlier_ok, start=1):
        prev = np.maximum(np.arange(n) - lag, 0)
        clicked_same |= ok & click[prev] & (item[prev] == item)
    conversion_logit = -1.5 - 0.6 * item_price[item] + 0.4 * item_quality[item]
    p_convert_given_click = _sigmoid(conversion_logit + 2.0 * clicked_same)
    convert = click & (rng.random(n) < p_convert_given_click)
    dwell = np.where(like, rng.lognormal(3.5, 0.8, n), rng.lognormal(1.5, 0.8, n))
    steps.update()

    steps.set_postfix_str("oracle")
    split_masks = (split or SplitConfig()).masks(user, timestamps, np.cumsum(lengths))
    is_train, is_eval = split_masks["train"], split_masks["eval"]
    # Reference for history-blind models: the true static logit, intercept refitted to the train click rate.
    shift = np.log(np.mean(p_click[is_train]) / np.mean(_sigmoid(static_logit[is_train])))
    static_click = _sigmoid(static_logit + shift)
    report = {
        "config": asdict(cfg),
        "signals": ["recent_interest", "saturation", "repeat_purchase", "static"],
        "eval_cutoff": int(timestamps[is_eval].min()) if is_eval.any() else None,
        "oracle_ne": {
            "click": _ne(p_click[is_eval], click[is_eval]),
            "convert": _ne((p_click * p_convert_given_click)[is_eval], convert[is_eval]),
        },
        "static_only_ne": {"click": _ne(static_click[is_eval], click[is_eval])},
        "share_with_recent_signal": round(float(np.mean(recent > 0)), 4),
    }
    steps.update()
    steps.close()

    bench = cfg.profile in BENCH_PROFILES
    surface_names = SURFACES + [f"surface_{i}" for i in range(len(SURFACES), cfg.surfaces)]
    context = [
        Categorical.single("ctx_surface", surface, cfg.surfaces, value_names=surface_names),
        Categorical.single("ctx_position", slot, cfg.positions),
    ]
    events = EventLog(
        users=user_raw[user],
        items=item_raw[item],
        timestamps=timestamps,
        labels={"click": click.astype(np.int8), "convert": convert.astype(np.int8)},
        actions={
            "click": click.astype(np.float32),
            "convert": convert.astype(np.float32),
            "like": like.astype(np.float32),
            "dwell": (np.log1p(dwell) / np.log1p(dwell.max())).astype(np.float32),
        },
        context=context
        if bench
        else [Categorical.single("ctx_device", device, len(DEVICES), value_names=DEVICES)] + context,
    )
    item_dense = {"item_quality": item_quality.astype(np.float32), "item_price": item_price.astype(np.float32)}
    user_dense = {"user_tenure": user_tenure}
    if bench:  # noise columns up to the benchmark's BENCH_DENSE dense features
        noise = BENCH_DENSE - len(TIME_FEATURES) - len(item_dense) - len(user_dense)
        for i in range(noise - noise // 2):
            item_dense[f"item_dense_{i}"] = rng.normal(size=cfg.items).astype(np.float32)
        for i in range(noise // 2):
            user_dense[f"user_dense_{i}"] = rng.normal(size=num_users).astype(np.float32)
    items = SideTable(
        source="synth items",
        raw_ids=item_raw,
        categorical=[
            Categorical.single("item_category", item_category, cfg.categories),
            Categorical.single("item_brand", item_brand, cfg.brands),
            Categorical("item_tags", item_tags.astype(np.int64), tag_offsets, cfg.tags),
        ],
        dense=item_dense,
    )
    demographics = [
        Categorical.single("user_country", user_country, 200),
        Categorical.single("user_age", user_age, 8),
        Categorical.single("user_gender", user_gender, 3),
    ]
    users = SideTable(
        source="synth users",
        raw_ids=user_raw,
        categorical=([] if bench else demographics)
        + [
            Categorical.single("user_segment", user_segment, cfg.segments),
            Categorical("user_interests", interests.astype(np.int64), interest_offsets, cfg.categories),
        ],
        dense=user_dense,
    )
    return events, items, users, report


def synthesize(
    out: Path, cfg: SynthConfig, split: SplitConfig | None = None, overwrite: bool = False, progress: bool = True
) -> Path:
    """Generate and write the dataset. The bench profiles always split by `last_event` (its `eval_fraction`
    or `cutoff` still apply) and has no aggregate features (its dense features are the benchmark's)."""
    bench = cfg.profile in BENCH_PROFILES
    if bench:
        split = replace(split or SplitConfig(), by="last_event")
    events, items, users, report = generate(cfg, split, progress=progress)
    return build_dataset(
        out,
        name=f"synth-{cfg.profile + '-' if bench else ''}{cfg.events}-seed{cfg.seed}",
        events=events,
        items=items,
        users=users,
        split=split,
        seq_item_features=BENCH_SEQ_FEATURES if bench else ["item_category", "item_brand", "item_tags"],
        hash_buckets={"item": cfg.item_hash_buckets} if cfg.item_hash_buckets else None,
        aggregates=not bench,
        extra={"synth": report},
        overwrite=overwrite,
        progress=progress,
    )
