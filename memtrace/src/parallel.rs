//! A map over a slice on every core (at most [`MAX_THREADS`]), for the
//! attach's per-object work (building unwind tables, searching objects for
//! allocator functions): items taken in a given order, results in the
//! slice's order, or ([`spawn`]) sent one by one from a thread of their own
//! while the caller goes on (tables prepared while tracing runs), whose
//! queue lets the caller move an item to the front (an object a stack
//! waits for).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Most threads: each may hold an object's symbol tables or CFI.
pub const MAX_THREADS: usize = 8;

/// `f` of every item, computed on up to
/// [`std::thread::available_parallelism`] threads taking the items in
/// `order` (indices; those missing are done last, in slice order); the
/// results in `items`' order.
pub fn map<T: Sync, R: Send>(items: &[T], order: &[usize], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let results: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    run(items, &Queue::new(order, items.len()), |i, item| {
        let result = f(item);
        if let Ok(mut slot) = results[i].lock() {
            *slot = Some(result);
        }
    });
    // A slot is empty only if `f` panicked on a worker, and then
    // `thread::scope` has already propagated the panic.
    results
        .into_iter()
        .filter_map(|slot| slot.into_inner().ok().flatten())
        .collect()
}

/// `f` of every item, computed as [`map`] does but on a thread of its own
/// (named `name`) while the caller goes on: each result is sent on
/// `results` as soon as it is done. Dropping the receiver lets the work
/// finish unheard. The queue returned moves an item not yet taken to the
/// front ([`Queue::promote`]).
pub fn spawn<T, R>(
    name: &str,
    items: Vec<T>,
    order: &[usize],
    f: impl Fn(&T) -> R + Send + Sync + 'static,
    results: std::sync::mpsc::Sender<R>,
) -> std::io::Result<Queue>
where
    T: Send + Sync + 'static,
    R: Send + 'static,
{
    let queue = Queue::new(order, items.len());
    let taken = queue.clone();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            run(&items, &taken, |_, item| {
                let _ = results.send(f(item));
            });
        })?;
    Ok(queue)
}

/// The indices of the items no worker has taken yet, in the order they
/// will be taken.
#[derive(Clone, Debug)]
pub struct Queue(Arc<Mutex<VecDeque<usize>>>);

impl Queue {
    /// `order` (indices below `len`, each once; those missing last, in
    /// order).
    fn new(order: &[usize], len: usize) -> Self {
        let mut queued = vec![false; len];
        let mut queue: VecDeque<usize> = order
            .iter()
            .copied()
            .filter(|&i| i < len && !std::mem::replace(&mut queued[i], true))
            .collect();
        queue.extend((0..len).filter(|&i| !queued[i]));
        Queue(Arc::new(Mutex::new(queue)))
    }

    /// The next item to take.
    fn pop(&self) -> Option<usize> {
        self.0.lock().ok()?.pop_front()
    }

    /// Makes item `i` the next one taken; false when it was taken already.
    pub fn promote(&self, i: usize) -> bool {
        let Ok(mut queue) = self.0.lock() else {
            return false;
        };
        match queue.iter().position(|&queued| queued == i) {
            Some(at) => {
                queue.remove(at);
                queue.push_front(i);
                true
            }
            None => false,
        }
    }
}

/// Calls `work` on every item (with its index) on up to
/// [`std::thread::available_parallelism`] threads (at most
/// [`MAX_THREADS`]) taking the items from `queue`; returns when it is empty
/// and every item taken is done.
fn run<T: Sync>(items: &[T], queue: &Queue, work: impl Fn(usize, &T) + Sync) {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, MAX_THREADS)
        .min(items.len());
    let worker = || {
        while let Some(i) = queue.pop() {
            if let Some(item) = items.get(i) {
                work(i, item);
            }
        }
    };
    if threads <= 1 {
        worker();
    } else {
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(worker);
            }
        });
    }
}

/// The order to take objects of these sizes in: the biggest first, so that
/// the longest job does not start last and leave the other threads idle;
/// equal sizes in their own order.
pub fn biggest_first(sizes: &[u64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(sizes[i]));
    order
}

/// The sizes of these files (0 for one that cannot be read).
pub fn file_sizes<'a>(paths: impl Iterator<Item = Option<&'a std::path::Path>>) -> Vec<u64> {
    paths
        .map(|path| {
            path.and_then(|p| std::fs::metadata(p).ok())
                .map_or(0, |m| m.len())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_biggest_objects_are_taken_first_ties_in_their_order() {
        assert_eq!(biggest_first(&[10, 500, 10, 0, 90]), [1, 4, 0, 2, 3]);
        assert!(biggest_first(&[]).is_empty());
    }

    #[test]
    fn results_keep_the_items_order_whatever_the_order_they_are_taken_in() {
        let items: Vec<u64> = (0..50).collect();
        let order: Vec<usize> = (0..50).rev().collect();
        assert_eq!(
            map(&items, &order, |n| n * 2),
            (0..50).map(|n| n * 2).collect::<Vec<_>>()
        );
        // Indices out of range or repeated are ignored; missing ones still run.
        assert_eq!(map(&items[..3], &[2, 2, 9], |n| n + 1), [1, 2, 3]);
        assert!(map(&[] as &[u64], &[], |n| *n).is_empty());
    }

    #[test]
    fn a_promoted_item_is_taken_next_unless_taken_already() {
        let queue = Queue::new(&[2, 0], 4);
        assert!(queue.promote(3));
        assert_eq!(queue.pop(), Some(3));
        assert_eq!(queue.pop(), Some(2));
        assert!(!queue.promote(2), "taken already");
        assert!(!queue.promote(9), "no such item");
        assert_eq!(queue.pop(), Some(0));
        assert_eq!(queue.pop(), Some(1));
        assert_eq!(queue.pop(), None);
    }

    #[test]
    fn spawned_work_sends_every_result_while_the_caller_goes_on() {
        let (tx, rx) = std::sync::mpsc::channel();
        let items: Vec<u64> = (0..20).collect();
        spawn("test-spawn", items, &[19, 0], |n| n * 3, tx).expect("a thread");
        let mut got: Vec<u64> = rx.iter().collect();
        got.sort_unstable();
        assert_eq!(got, (0..20).map(|n| n * 3).collect::<Vec<_>>());
    }
}
