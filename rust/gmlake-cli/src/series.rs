//! A downsampled time series of memory over a replay, for the chart: at most a fixed number of
//! points, each the maximum of its bucket of consecutive events (so peaks survive).

/// Memory after one bucket of events (each figure the bucket's maximum).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Point {
    /// Index of the bucket's last event.
    pub event: u64,
    pub active: u64,
    /// Physical memory held by our allocator.
    pub reserved: u64,
    /// The native allocator's running segment sum (add `NativeMeter::offset`).
    pub native: i64,
}

#[derive(Clone, Debug, Default)]
pub struct Series {
    bucket: usize,
    left: usize,
    cur: Point,
    points: Vec<Point>,
}

impl Series {
    /// A series of at most `max_points` points over `events` events; `max_points == 0`
    /// records nothing.
    pub fn new(events: usize, max_points: usize) -> Series {
        if max_points == 0 || events == 0 {
            return Series::default();
        }
        let bucket = events.div_ceil(max_points).max(1);
        Series {
            bucket,
            left: bucket,
            cur: Point {
                native: i64::MIN,
                ..Point::default()
            },
            points: Vec::with_capacity(events.div_ceil(bucket)),
        }
    }

    /// Records the memory after event `index` (events must come in order, one call each).
    #[inline]
    pub fn record(&mut self, index: usize, active: u64, reserved: u64, native: i64) {
        if self.bucket == 0 {
            return;
        }
        let c = &mut self.cur;
        c.active = c.active.max(active);
        c.reserved = c.reserved.max(reserved);
        c.native = c.native.max(native);
        self.left -= 1;
        if self.left == 0 {
            self.flush(index);
        }
    }

    fn flush(&mut self, index: usize) {
        self.cur.event = index as u64;
        self.points.push(self.cur);
        self.cur = Point {
            native: i64::MIN,
            ..Point::default()
        };
        self.left = self.bucket;
    }

    /// Closes the last, partial bucket; `last_index` is the index of the last event recorded.
    pub fn finish(&mut self, last_index: usize) {
        if self.bucket != 0 && self.left != self.bucket {
            self.flush(last_index);
        }
    }

    pub fn points(&self) -> &[Point] {
        &self.points
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_keep_the_maximum() {
        let mut s = Series::new(10, 4); // buckets of 3 events
        for i in 0..10 {
            let v = if i == 4 { 100 } else { i as u64 };
            s.record(i, v, v * 2, -(i as i64));
        }
        s.finish(9);
        let p = s.points();
        assert_eq!(p.len(), 4);
        assert_eq!(
            p.iter().map(|p| p.event).collect::<Vec<_>>(),
            vec![2, 5, 8, 9]
        );
        assert_eq!(
            p.iter().map(|p| p.active).collect::<Vec<_>>(),
            vec![2, 100, 8, 9]
        );
        assert_eq!(p[1].reserved, 200);
        assert_eq!(p[1].native, -3);
    }

    #[test]
    fn disabled_series_records_nothing() {
        let mut s = Series::new(10, 0);
        s.record(0, 1, 1, 1);
        s.finish(0);
        assert!(s.points().is_empty());
        let mut s = Series::new(2, 1000);
        s.record(0, 1, 1, 1);
        s.record(1, 2, 2, 2);
        s.finish(1);
        assert_eq!(s.points().len(), 2);
    }
}
