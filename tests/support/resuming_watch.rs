//! A watch of one kind that misses nothing it can help missing: it lists, then watches from the
//! list's resourceVersion and, whenever the stream ends, resumes from the last resourceVersion it
//! saw (so what was written while the apiserver was down or restarting is still delivered); only a
//! resourceVersion too old to resume from (410) makes it list again, and that gap is reported.

use std::time::Duration;

use futures::StreamExt as _;
use kube::Api;
use kube::api::{DynamicObject, ListParams, WatchEvent, WatchParams};
use tokio::task::JoinHandle;

/// What the watch saw.
pub enum Watched<'a> {
    /// Every object, from the first list (`relisted` false) or from a list after a 410 (true:
    /// versions written in between are lost).
    Listed {
        objects: &'a [DynamicObject],
        relisted: bool,
    },
    /// An object added or modified.
    Changed(&'a DynamicObject),
    /// An object deleted, as it was last.
    Deleted(&'a DynamicObject),
    /// The stream ended and is resumed from where it was.
    Resumed,
}

/// Lists `api` (panics when it cannot: the watch would start blind) and hands `on` the list, then
/// every event from a watch that resumes as the module says, until the returned task is aborted.
pub async fn watch_resuming(
    api: Api<DynamicObject>,
    mut on: impl FnMut(Watched<'_>) + Send + 'static,
) -> JoinHandle<()> {
    let list = api
        .list(&ListParams::default())
        .await
        .unwrap_or_else(|e| panic!("list the objects to watch: {e}"));
    on(Watched::Listed {
        objects: &list.items,
        relisted: false,
    });
    let mut rv = list.metadata.resource_version.unwrap_or_default();
    tokio::spawn(async move {
        loop {
            let params = WatchParams::default().timeout(290);
            let stream = match api.watch(&params, &rv).await {
                Ok(s) => s,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            let mut stream = std::pin::pin!(stream);
            let mut expired = false;
            while let Some(event) = stream.next().await {
                match event {
                    Ok(WatchEvent::Added(o)) | Ok(WatchEvent::Modified(o)) => {
                        rv = o.metadata.resource_version.clone().unwrap_or_default();
                        on(Watched::Changed(&o));
                    }
                    Ok(WatchEvent::Deleted(o)) => {
                        rv = o.metadata.resource_version.clone().unwrap_or_default();
                        on(Watched::Deleted(&o));
                    }
                    Ok(WatchEvent::Bookmark(b)) => rv = b.metadata.resource_version,
                    Ok(WatchEvent::Error(status)) => {
                        expired = status.code == 410;
                        break;
                    }
                    Err(_) => break,
                }
            }
            if expired {
                match api.list(&ListParams::default()).await {
                    Ok(list) => {
                        on(Watched::Listed {
                            objects: &list.items,
                            relisted: true,
                        });
                        rv = list.metadata.resource_version.unwrap_or_default();
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            } else {
                on(Watched::Resumed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    })
}
