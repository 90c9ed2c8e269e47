//! The join of a batch's items: every item runs at once, and each is polled again only when
//! it was woken.
//!
//! `futures_util::future::join_all` does the same for large sets through
//! `FuturesUnordered`, which moves each future into its task node by value: a batch item's
//! future is a few kilobytes, and those copies were the largest single cost of a batch item
//! in the engine. Here each future is boxed where it is made and never moved again, and its
//! waker is a small node that queues its index.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// The items woken since the join was last polled, and the join's own waker.
#[derive(Default)]
struct Woken {
    queue: Mutex<Vec<usize>>,
    join: AtomicWaker,
}

/// One item's waker: queues the item's index once until it is polled.
struct ItemWaker {
    index: usize,
    queued: AtomicBool,
    woken: Arc<Woken>,
}

impl Wake for ItemWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            self.woken
                .queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(self.index);
            self.woken.join.wake();
        }
    }
}

enum Slot<F: Future> {
    Running {
        run: Pin<Box<F>>,
        node: Arc<ItemWaker>,
        waker: Waker,
    },
    Done(F::Output),
    Taken,
}

/// Runs every future of `runs` at once and returns their outputs in input order.
pub(crate) async fn join_woken<F: Future>(runs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let woken = Arc::new(Woken::default());
    let mut slots: Vec<Slot<F>> = runs
        .enumerate()
        .map(|(index, run)| {
            let node = Arc::new(ItemWaker {
                index,
                queued: AtomicBool::new(true),
                woken: woken.clone(),
            });
            Slot::Running {
                run: Box::pin(run),
                waker: Waker::from(node.clone()),
                node,
            }
        })
        .collect();
    let mut running = slots.len();
    let mut due: Vec<usize> = (0..slots.len()).collect();
    std::future::poll_fn(move |cx| {
        woken.join.register(cx.waker());
        due.append(&mut woken.queue.lock().unwrap_or_else(PoisonError::into_inner));
        // One pass over the items woken so far. An item woken while it is polled (one that
        // yields, or a tokio resource out of its task's budget) is polled on the join's next
        // poll: its wake has already asked the executor for it.
        for index in due.drain(..) {
            let Some(slot) = slots.get_mut(index) else {
                continue;
            };
            let Slot::Running { run, node, waker } = slot else {
                continue;
            };
            node.queued.store(false, Ordering::Release);
            if let Poll::Ready(out) = run.as_mut().poll(&mut Context::from_waker(waker)) {
                *slot = Slot::Done(out);
                running -= 1;
            }
        }
        if running > 0 {
            return Poll::Pending;
        }
        let outputs = slots
            .iter_mut()
            .filter_map(|slot| match std::mem::replace(slot, Slot::Taken) {
                Slot::Done(out) => Some(out),
                _ => None,
            })
            .collect();
        Poll::Ready(outputs)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A future that is ready once `open` is set, counting its polls.
    async fn gate(open: Arc<tokio::sync::Notify>, polls: Arc<AtomicUsize>, out: usize) -> usize {
        let notified = open.notified();
        tokio::pin!(notified);
        std::future::poll_fn(|cx| {
            polls.fetch_add(1, Ordering::Relaxed);
            notified.as_mut().poll(cx)
        })
        .await;
        out
    }

    #[tokio::test]
    async fn outputs_come_in_input_order_and_only_woken_items_are_polled_again() {
        let gates: Vec<_> = (0..50)
            .map(|_| Arc::new(tokio::sync::Notify::new()))
            .collect();
        let polls: Vec<_> = (0..50).map(|_| Arc::new(AtomicUsize::new(0))).collect();
        let runs: Vec<_> = (0..50)
            .map(|i| gate(gates[i].clone(), polls[i].clone(), i * 10))
            .collect();
        let join = tokio::spawn(join_woken(runs.into_iter()));
        tokio::task::yield_now().await;
        // Opened in reverse order, one at a time, from another task.
        for i in (0..50).rev() {
            gates[i].notify_one();
            tokio::task::yield_now().await;
        }
        let outputs = join.await.expect("the join ran");
        assert_eq!(outputs, (0..50).map(|i| i * 10).collect::<Vec<_>>());
        for (i, polls) in polls.iter().enumerate() {
            assert_eq!(
                polls.load(Ordering::Relaxed),
                2,
                "item {i}: its first poll and the one it was woken for"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn items_woken_from_other_threads_all_finish() {
        let runs = (0..200).map(|i| async move {
            for _ in 0..3 {
                tokio::task::spawn_blocking(|| ())
                    .await
                    .expect("blocking task");
            }
            i
        });
        let outputs = join_woken(runs).await;
        assert_eq!(outputs, (0..200).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn items_that_wake_themselves_do_not_hold_the_thread() {
        // Each item wakes itself while it is polled (as a tokio resource out of its task's
        // budget does) until another task on the same thread has run, or 10,000 times. A
        // join that polled them again within its own poll would never give the thread back.
        let ran = Arc::new(AtomicBool::new(false));
        let other = tokio::spawn({
            let ran = ran.clone();
            async move { ran.store(true, Ordering::Release) }
        });
        let runs = (0..20).map(|_| {
            let ran = ran.clone();
            let mut left = 10_000;
            std::future::poll_fn(move |cx| {
                if ran.load(Ordering::Acquire) || left == 0 {
                    return Poll::Ready(ran.load(Ordering::Acquire));
                }
                left -= 1;
                cx.waker().wake_by_ref();
                Poll::Pending
            })
        });
        assert!(
            join_woken(runs).await.into_iter().all(|saw| saw),
            "the other task ran meanwhile"
        );
        other.await.expect("the other task ran");
    }

    #[tokio::test]
    async fn no_items_is_no_outputs() {
        let outputs = join_woken(std::iter::empty::<std::future::Ready<u8>>()).await;
        assert!(outputs.is_empty());
    }

    #[tokio::test]
    async fn dropping_the_join_drops_every_running_item() {
        struct Dropped(Arc<AtomicUsize>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let dropped = Arc::new(AtomicUsize::new(0));
        let runs = (0..10).map(|i| {
            let guard = Dropped(dropped.clone());
            async move {
                if i % 2 == 0 {
                    std::future::pending::<()>().await;
                }
                drop(guard);
                i
            }
        });
        let mut join = Box::pin(join_woken(runs));
        let first = std::future::poll_fn(|cx| Poll::Ready(join.as_mut().poll(cx))).await;
        assert!(first.is_pending(), "five items never finish");
        assert_eq!(dropped.load(Ordering::Relaxed), 5, "the five that finished");
        drop(join);
        assert_eq!(dropped.load(Ordering::Relaxed), 10);
    }
}
