"""Group formation for one averaging round: discovery records plus a leader that seals the group.

Every peer that wants to average under a group key (e.g. ``round7``) registers itself in discovery under
``<prefix>.mm.<key>``. The registered peer with the smallest PeerID (dialable peers first, below) leads: the others open
a *join* stream to it and wait; the leader seals the group when it has the expected number of members, when nobody new
has joined for ``matchmaking_timeout_s``, or when the earliest member's whole wait (``max_wait_s``) runs out, and
answers every waiting member with the same member list. A leader that discovers a smaller registered peer hands its
followers over to that peer (a redirect) and joins it itself, so concurrent views of the discovery records converge on
one leader. "Smaller" orders peers that can be dialed before dial-only ones (behind a NAT, reached through a relay or
not at all: their record says ``"dial_only": true``), then by PeerID: every follower dials its leader, and only a
dialable leader takes the joins directly. A leader watches every join stream: a follower whose stream closes before the
seal (its process died) is left out of the group.

The leader can refuse a member (``admit`` callback): DiLoCo refuses peers whose outer state digest differs from its
own, so a group never mixes peers that disagree on theta_outer; the refused peer re-synchronizes its state instead.

The wait is an *idle* window, restarted whenever the group grows, not a deadline counted from the first arrival:
peers reach a round's rendezvous spread out by how long their previous round took (on a loaded machine, or with a
slow group, the spread exceeds any fixed window), and a window counted from the first arrival sealed the group while
the rest were still on their way, failing their round. While members keep arriving the group waits (up to
``max_wait_s``); once they stop, it seals ``matchmaking_timeout_s`` later, so a peer that died before the seal
still costs one timeout. A peer that nevertheless arrives after the seal can ask (``on_late="next"``) to form the
next group of late peers under a successor key instead of failing its round.

The expected size comes from the peer's own view of the swarm (DiLoCo: the live workers' status records), and a
view read from a loaded DHT lacks records: a leader counting 42 of 64 workers sealed at the 43rd arrival and left the
rest out of the round. So views are pooled (``expected_peers``): every member sends the PeerIDs it expects with its
join request (``expects``), and the leader seals early only once every peer that any member expects has joined; a
peer that all views lack is the only one still missed. A peer that some view wrongly holds (it died moments ago)
costs one idle window, as in a view of one.

When the members are known in advance (``expected_members``: Moshpit's sharded rendezvous, where every peer computes
its 2-M groupmates from the grid) the idle window is the wrong rule: a group of three sees gaps between its members'
arrivals as long as their previous rounds' spread, and sealed short after one quiet window (a third to a half of
the rounds of 8 real peers ran alone). Such a group instead waits for exactly those members and seals the moment the
last one joins; a member that never comes is left out when the earliest member's ``max_wait_s`` runs out, and the
others average without it. A member whose process died never comes either, and is not waited for that long: once
the group has gained nobody for ``matchmaking_timeout_s``, its leader probes the missing members, and one that
answers no probe twice in a row is left out (the group seals about two idle windows after its last arrival). A live
member can be just as absent: its view of the swarm differed (a status record that lapsed under load gives another
grid) and it is matchmaking for another group of the same round. A probe's answer lists the keys the member is
matchmaking for or sealed lately; one under another key of the round (``round_prefix``) is left out at once.

Under load the margins are thin. A leader seals at the earliest follower's deadline and that follower gives up one
``request_timeout_s`` later, so nothing the leader does while waiting (a discovery read that takes seconds on a
loaded DHT, a hand-over to a smaller peer found at the last moment) may push the seal past it. A follower that
failed to reach a leader (a loaded leader read its request too late) tries it again when a groupmate redirects it
there (up to 2 failed attempts), instead of bouncing between the two until ``max_wait_s``.

A leader that seals says so in its discovery record (``"sealed": true``). A peer that arrives after the seal and
would lead (its PeerID is smaller than the sealer's, so nobody redirects it there) reads that record at its next
poll and asks the sealer, which answers it is late like any other latecomer (``on_late``), or gives it the group
when it is a member that lost the answer, instead of leading a group of one for a whole idle window:
in a DiLoCo run such a peer averaged alone, came out of every later round's boundary one window after the others,
and so missed every later group too. Told at once, it learns that the round went on without it and catches up.

The package: :mod:`~protocols.matchmaking.config` (the config, the sealed :class:`Group` and the failures),
:mod:`~protocols.matchmaking.session` (one key's matchmaking state and the leader's pure decisions on it) and
:mod:`~protocols.matchmaking.matchmaker` (the runner, :class:`Matchmaker`); the only I/O goes through the handed
:class:`protocols.interfaces.Transport`.
"""

from protocols.matchmaking.config import (
    AdmissionRefused, AdmitFn, Group, MatchmakingConfig, MatchmakingFailed, SealedWithout,
)
from protocols.matchmaking.matchmaker import Matchmaker

__all__ = [
    "AdmissionRefused", "AdmitFn", "Group", "Matchmaker", "MatchmakingConfig", "MatchmakingFailed", "SealedWithout",
]
