//! Meta mode's object broadcasts between the job's processes (`broadcast_object_list`,
//! `scatter_object_list`).
//!
//! In meta mode tensors carry no bytes, so a rank that receives a pickled object from another
//! would get nothing (`python/podsim/_meta_objects.py`). The job's processes - the
//! representatives and the verified ranks - all talk to this one worker (a torch job has one),
//! so the source's pickle, when the source is one of them, is handed over here: the source
//! posts it under the call's index in its program (alike in every process, as their
//! collectives are checked to be), and a receiver fetches it, waiting until it is posted. A
//! receiver whose source is no process of the job (a rank its representative stands for), or
//! whose source ended without posting, gets nothing and keeps its own list.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use tokio::sync::Notify;

/// The pickles posted so far, by (source rank, call index), as f32 words.
#[derive(Debug, Default)]
pub struct Board {
    /// The ranks that run as processes of this job.
    running: HashSet<u32>,
    posted: Mutex<HashMap<(u32, u64), Vec<f32>>>,
    ended: Mutex<HashSet<u32>>,
    changed: Notify,
}

impl Board {
    pub fn new(running: impl IntoIterator<Item = u32>) -> Board {
        Board {
            running: running.into_iter().collect(),
            ..Board::default()
        }
    }

    /// Rank `src` posts its pickle for its `key`-th sourced object call.
    pub fn post(&self, src: u32, key: u64, words: Vec<f32>) {
        if let Ok(mut posted) = self.posted.lock() {
            posted.insert((src, key), words);
        }
        self.changed.notify_waiters();
    }

    /// Rank `rank`'s program ended: what it did not post, it never will.
    pub fn end(&self, rank: u32) {
        if let Ok(mut ended) = self.ended.lock() {
            ended.insert(rank);
        }
        self.changed.notify_waiters();
    }

    /// Rank `src`'s pickle for its `key`-th sourced object call, once posted; `None` when
    /// `src` is no process of the job or ended without posting it.
    pub async fn fetch(&self, src: u32, key: u64) -> Option<Vec<f32>> {
        if !self.running.contains(&src) {
            return None;
        }
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(words) = self.posted.lock().ok()?.get(&(src, key)) {
                return Some(words.clone());
            }
            if self.ended.lock().ok()?.contains(&src) {
                return None;
            }
            notified.await;
        }
    }
}

/// Ends rank `rank` on the board when dropped: a serving that ends, or is dropped mid-run
/// by another rank's failure, releases whoever waits for its posts.
pub struct EndsOnBoard<'a>(pub &'a Board, pub u32);

impl Drop for EndsOnBoard<'_> {
    fn drop(&mut self) {
        self.0.end(self.1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_fetch_waits_for_the_post_and_an_absent_source_gives_nothing() {
        let board = std::sync::Arc::new(Board::new([0, 5]));
        let waiting = {
            let board = board.clone();
            tokio::spawn(async move { board.fetch(0, 3).await })
        };
        tokio::task::yield_now().await;
        board.post(0, 3, vec![1.0, 2.0]);
        assert_eq!(waiting.await.unwrap(), Some(vec![1.0, 2.0]));
        // A rank its representative stands for posts nothing: no wait.
        assert_eq!(board.fetch(7, 0).await, None);
        // A source that ended without posting releases its receivers.
        let waiting = {
            let board = board.clone();
            tokio::spawn(async move { board.fetch(5, 0).await })
        };
        tokio::task::yield_now().await;
        drop(EndsOnBoard(&board, 5));
        assert_eq!(waiting.await.unwrap(), None);
    }
}
