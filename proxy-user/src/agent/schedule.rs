//! When the agent syncs: kube-proxy's `BoundedFrequencyRunner` (`pkg/util/async`, now
//! `runner/bounded_frequency_runner.go`) as a pure state machine with the clock passed
//! in. Changes are coalesced: a sync runs at most every `min_interval`, and whatever
//! arrived meanwhile is written together; a full re-diff is asked for every
//! `resync_every`; after a sync with failed writes the next one waits an exponential
//! backoff (never less than `min_interval`), reset by the first complete sync.

use std::time::{Duration, Instant};

/// Exponential retry delay after failed syncs.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
    min: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Self {
        Self {
            next: min,
            min,
            max,
        }
    }

    /// The delay before the next retry; doubles each time up to `max`.
    pub fn fail(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    pub fn reset(&mut self) {
        self.next = self.min;
    }
}

/// The sync schedule.
#[derive(Debug)]
pub struct Schedule {
    min_interval: Duration,
    resync_every: Duration,
    backoff: Backoff,
    last_sync: Option<Instant>,
    retry_at: Option<Instant>,
    next_resync: Instant,
}

impl Schedule {
    /// The first periodic resync is due `resync_every` after `now`.
    pub fn new(
        min_interval: Duration,
        resync_every: Duration,
        backoff: Backoff,
        now: Instant,
    ) -> Self {
        Self {
            min_interval,
            resync_every,
            backoff,
            last_sync: None,
            retry_at: None,
            next_resync: now + resync_every,
        }
    }

    /// When the next sync may run if work is `pending` (None: nothing to do): not before
    /// `min_interval` after the last one, nor before a pending retry.
    pub fn next_sync(&self, pending: bool, now: Instant) -> Option<Instant> {
        if !pending {
            return None;
        }
        let earliest = self.last_sync.map_or(now, |t| t + self.min_interval);
        Some(self.retry_at.map_or(earliest, |r| r.max(earliest)))
    }

    /// When the loop must wake up next: for a due sync or the periodic resync.
    pub fn wake_at(&self, pending: bool, now: Instant) -> Instant {
        self.next_sync(pending, now)
            .map_or(self.next_resync, |s| s.min(self.next_resync))
    }

    /// Whether the periodic full re-diff is due at `now`; if so the next one is planned
    /// `resync_every` later (missed periods are not made up for).
    pub fn take_resync(&mut self, now: Instant) -> bool {
        if now < self.next_resync {
            return false;
        }
        while self.next_resync <= now {
            self.next_resync += self.resync_every;
        }
        true
    }

    /// Records a sync that ran at `now`; `failed` writes make the next one wait the
    /// backoff, returned.
    pub fn synced(&mut self, now: Instant, failed: bool) -> Option<Duration> {
        self.last_sync = Some(now);
        if failed {
            let delay = self.backoff.fail();
            self.retry_at = Some(now + delay);
            Some(delay)
        } else {
            self.backoff.reset();
            self.retry_at = None;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn schedule(t0: Instant) -> Schedule {
        Schedule::new(
            50 * MS,
            Duration::from_secs(30),
            Backoff::new(500 * MS, Duration::from_secs(30)),
            t0,
        )
    }

    #[test]
    fn backoff_doubles_up_to_the_limit() {
        let mut b = Backoff::new(Duration::from_millis(500), Duration::from_secs(2));
        let got: Vec<u128> = (0..4).map(|_| b.fail().as_millis()).collect();
        assert_eq!(got, [500, 1000, 2000, 2000]);
        b.reset();
        assert_eq!(b.fail().as_millis(), 500);
    }

    #[test]
    fn the_first_change_syncs_at_once_then_at_most_every_min_interval() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        assert_eq!(s.next_sync(false, t0), None, "nothing pending, nothing due");
        assert_eq!(s.next_sync(true, t0), Some(t0));
        s.synced(t0, false);
        // Changes 10 ms later wait for the interval: they are coalesced into one sync.
        assert_eq!(s.next_sync(true, t0 + 10 * MS), Some(t0 + 50 * MS));
        assert_eq!(s.wake_at(true, t0 + 10 * MS), t0 + 50 * MS);
        // Long after the last sync: due already (at once).
        let late = t0 + 5000 * MS;
        assert!(s.next_sync(true, late).is_some_and(|d| d <= late));
    }

    #[test]
    fn failed_syncs_back_off_and_a_complete_one_resets() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        assert_eq!(s.synced(t0, true), Some(500 * MS));
        assert_eq!(s.next_sync(true, t0 + 100 * MS), Some(t0 + 500 * MS));
        let t1 = t0 + 500 * MS;
        assert_eq!(s.synced(t1, true), Some(1000 * MS));
        assert_eq!(s.next_sync(true, t1), Some(t1 + 1000 * MS));
        let t2 = t1 + 1000 * MS;
        assert_eq!(s.synced(t2, false), None);
        assert_eq!(
            s.next_sync(true, t2 + 10 * MS),
            Some(t2 + 50 * MS),
            "min interval only"
        );
        assert_eq!(s.synced(t2 + 60 * MS, true), Some(500 * MS), "reset");
    }

    #[test]
    fn the_periodic_resync_is_due_every_period_without_catching_up() {
        let t0 = Instant::now();
        let mut s = schedule(t0);
        let period = Duration::from_secs(30);
        assert_eq!(s.wake_at(false, t0), t0 + period);
        assert!(!s.take_resync(t0 + period - MS));
        assert!(s.take_resync(t0 + period));
        assert!(!s.take_resync(t0 + period), "once per period");
        assert_eq!(s.wake_at(false, t0 + period), t0 + 2 * period);
        // The loop was away for three periods: one resync, the next one period on.
        assert!(s.take_resync(t0 + 5 * period + MS));
        assert!(!s.take_resync(t0 + 5 * period + 2 * MS));
        assert_eq!(s.wake_at(false, t0), t0 + 6 * period);
        // A due sync earlier than the resync wakes the loop first.
        assert_eq!(s.wake_at(true, t0 + period), t0 + period);
    }
}
